"""Identities of encoders: what in code, attributes and archives must change an encoder's key.

An encoder's fingerprint hashes its identity string and its weights; these functions build the
identity part for each kind of encoder (see :mod:`featbake.encode.encoders`).
"""

from __future__ import annotations

import ast
import collections
import datetime
import decimal
import dis
import enum
import fractions
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import itertools
import json
import logging
import multiprocessing
import os
import re
import sys
import sysconfig
import threading
import types
import uuid
import warnings
import weakref
import zipfile
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import torch
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from featbake.keys import (
    argument_names,
    attribute_names,
    canonical_json,
    contained_tensors,
    derived_state,
    inlined_comprehensions,
    is_library_code,
    method_function,
    module_derived,
    module_fingerprint,
    outermost_scripts,
    public_attributes,
    reached_code,
    reads_training,
    records_into,
    state_dict_fingerprint,
    tensor_attributes,
    unwrapped,
    written_below,
)
from featbake.keys import keyed_attribute as keyed_attribute
from featbake.store.shard import crc32c_tensor, tensor_buffer


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


def attribute_identity(module: Any) -> str:
    """SHA-256 of every submodule's plain attributes (numbers, strings, tuples of them), and of
    the data and callables a module class of the user's holds (:func:`held_attribute_text`).

    ``self.scale = 2.0`` used in ``forward`` changes outputs without changing code or weights, so
    it must change the key; so must ``self.cfg = {"scale": 2.0}`` edited, or ``self.act =
    partial(torch.mul, other=2.0)`` replaced. Private attributes (torch's own bookkeeping),
    ``training`` (always eval here) and derived state the forward writes
    (:func:`module_derived`) are left out.
    """
    subs = module.named_modules() if hasattr(module, "named_modules") else [("", module)]
    rows = []
    for name, sub in subs:
        derived = module_derived(sub)
        held = reads_held_attributes(sub)
        for key, value in public_attributes(sub).items():
            if not keyed_attribute(key) or derived_state(derived, key, value):
                continue
            row = attribute_row(name, sub, key, value, derived, held)
            if row is not None:
                rows.append(row)
    return attribute_digest(rows)


def attribute_row(
    name: str, sub: Any, key: str, value: Any, derived: frozenset[str], reads_held: bool
) -> list[str] | None:
    """The row :func:`attribute_identity` keys for attribute ``key`` (holding ``value``) of
    submodule ``name`` (``sub``), a keyed name that is no derived state: a plain value by its
    ``repr``, a held value (:func:`held_attribute`, where ``reads_held``) by
    :func:`held_attribute_text`; None for what no such row reads (a tensor, a module, a held
    value meeting what no key reads). Shared with the watch's exact read
    (:func:`~featbake.serve.cached_encoder.structure_read`), so both key alike."""
    if _primitive(value):
        return [name, key, repr(value)]
    if (reads_held or model_config(value)) and held_attribute(key, value, derived):
        text = held_attribute_text(sub, value, exact=True, key=key)
        return None if text is None else [name, key, text]
    return None


def reads_held_attributes(module: Any) -> bool:
    """Whether a key reads ``module``'s held attributes (:func:`held_attribute`): a class of
    the user's. A library's classes (torch's, transformers') keep the keys they had: their
    held values are library functions and configs read by their own code, and a torch
    upgrade must not change every key (as :func:`code_identity` leaves torch out)."""
    return not is_library_code(type(module))


#: transformers' config base class, by module and name (``PretrainedConfig`` before 5.0).
_CONFIG_CLASSES = {
    ("transformers.configuration_utils", "PreTrainedConfig"),
    ("transformers.configuration_utils", "PretrainedConfig"),
}


def model_config(value: Any) -> bool:
    """Whether ``value`` is a transformers model config (found without importing
    transformers). A library module's held values are not keyed (:func:`reads_held_attributes`)
    but its config is: a transformers model's forward reads ``self.config`` (``config.
    output_hidden_states = True`` makes it return the hidden states), and a
    :class:`~featbake.serve.cached_encoder.CachedEncoder` kept serving the outputs of the
    config it was wrapped with. Read by :func:`config_text`, by the key and the watch alike."""
    return any((c.__module__, c.__name__) in _CONFIG_CLASSES for c in type(value).__mro__)


def config_text(config: Any, *, exact: bool) -> str:
    """A transformers config as a key reads it (``exact``): the digest of its settings as
    saved (``to_dict``), without ``_name_or_path`` (where it was loaded from is no setting).
    Else as a watch reads it at each forward, ten times faster (``to_dict`` copies the whole
    config): its attributes as they are, which change whenever its settings do (a difference
    sends the watch to the exact read)."""
    if not exact:
        try:
            return f"config~{json.dumps(vars(config), default=_config_part)}"
        except (TypeError, ValueError):  # a key json cannot write, or a cycle
            pass
    settings = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    text = json.dumps(settings, sort_keys=True, default=str)
    return f"config({hashlib.sha256(text.encode()).hexdigest()})"


def _config_part(value: Any) -> Any:
    """A config's value json cannot write, as a watch reads it: a nested config (CLIP's
    ``vision_config``) by its attributes, anything else by its repr."""
    return vars(value) if model_config(value) else repr(value)


def held_attribute(key: str, value: Any, derived: frozenset[str]) -> bool:
    """Whether attribute ``key`` holding ``value`` is read as a hook's held value is
    (:func:`held_attribute_text`): anything but derived state (``derived``: what the forward
    writes or records into, :func:`module_derived`), a plain value, a tensor, a class or a
    Python module (each read by the rules it had), a list, tuple or dict holding
    tensors (read by their versions), or ``forward`` set on the instance (refused while it
    differs: no key reads it): a settings dict, a ``SimpleNamespace``, ``argparse.Namespace``
    or dataclass, a config object, a function or lambda, a partial, a bound method, a builtin
    bound to an object (a settings dict's ``get``), a numpy array (a window, a mean), a module
    set on the instance without being registered (``self.__dict__["teacher"] = m``, kept out of
    ``state_dict`` and ``.to()``: read by its state, :func:`global_module_digest`; no key read
    it before)."""
    if key in derived or key == "forward" or _primitive(value):
        return False
    if isinstance(value, _READ_OTHERWISE):
        return False
    return not contained_tensors("", value) if type(value) in (list, tuple, dict) else True


_READ_OTHERWISE = (torch.Tensor, type, types.ModuleType)


def held_attribute_text(module: Any, value: Any, *, exact: bool, key: str = "") -> str | None:
    """An attribute value of ``module`` as a key reads it: by the one rule for a hook's held
    value (:class:`HeldReading`: a dict by its items, a function by its code, cells and
    defaults, a partial by its function and arguments, a bound method by its function and
    object), ``module``'s own submodules and tensors by their type (its key reads them), a
    tensor held inside an object, namespace or dataclass by its values, a module held so by
    its state (:func:`global_module_digest`). None where the reading meets what no key reads
    (a tensor in a plain list or dict, which the key reads as a buffer, an address, a held
    module with hooks of its own or in train mode): left out of the key as before, not
    refused. A
    numpy array by its values (:func:`global_tensor_digest`, as a hook's global array).
    ``exact``: as a key reads it (an array or a global module's weights hashed anew); else
    as a watch reads it at each forward: an array of up to :data:`WATCHED_ARRAY_BYTES`
    hashed anew too (it keeps no version, so an edit in place shows only in its bytes), a
    larger one kept while its stamp holds, as a hook's global array is (an edit in place is
    seen at the next exact check). ``key``: the attribute's name; what the module's forward
    sets on objects held under it (:func:`~featbake.keys.written_below`) is left out, derived
    state (a tensor a forward keeps on a monitor object would change the key at every run).

    Example:
        >>> import functools
        >>> rounding = functools.partial(round, ndigits=2)
        >>> held_attribute_text(torch.nn.Identity(), rounding, exact=True)
        'held:partial(builtin(round,),ndigits=2)'
    """
    if model_config(value):
        return f"held:{config_text(value, exact=exact)}"
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return None  # an array of objects: its bytes are addresses
        exact = exact or value.nbytes <= WATCHED_ARRAY_BYTES
        return f"held:ndarray({global_tensor_digest(value, exact=exact)})"
    # A plain list, tuple or dict holding tensors is keyed as buffers are (tensor_attributes)
    # and never read here (held_attribute); a tensor inside anything else, at any depth (a
    # namespace in a list), by its values.
    written = written_below(type(module)).get(key, frozenset()) if key else frozenset()
    reading = HeldReading(_TreeIds(module), exact=exact, tensors=True, written=written)
    text = reading.text(value)
    return None if reading.refused else f"held:{text}"


#: The largest numpy array attribute a watch hashes at every forward (about 0.1 ms).
WATCHED_ARRAY_BYTES = 64 << 10


def _hashed_at_each_read(value: torch.Tensor | np.ndarray) -> bool:
    """Whether a global array or tensor is hashed at each of a watch's reads, not trusted
    while its stamp holds: a numpy array (it keeps no version: ``WIN[0] = 3`` shows only in
    its bytes) or a CPU tensor (``torch.from_numpy``'s, edited through numpy, moves no
    version) of up to :data:`WATCHED_ARRAY_BYTES`, as a held array attribute is."""
    small = value.nbytes <= WATCHED_ARRAY_BYTES
    return small and (isinstance(value, np.ndarray) or value.device.type == "cpu")


class _TreeIds(Container[int]):
    """The ids of a module's submodules and tensors, listed at the first question: most held
    values hold none, and a watch reads them at every forward of a large tree."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._ids: set[int] | None = None

    def inside(self, other: torch.nn.Module) -> bool:
        """Whether the module these ids are of is ``other`` or one of its submodules (a
        submodule holding its owner in a list or namespace, not registered)."""
        return any(sub is self.module for sub in other.modules())

    def __contains__(self, key: object) -> bool:
        if self._ids is None:
            m = self.module
            self._ids = {id(o) for o in itertools.chain(m.modules(), m.parameters(), m.buffers())}
        return key in self._ids


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


#: Modules whose hooks are library machinery, left out of keys: torch's own (the old-API
#: ``weight_norm`` and ``spectral_norm`` hooks, whose effect is in the weights; the global hooks
#: of ``FlopCounterMode`` and ``ModuleTracker``) and transformers' output capturing (the hooks
#: ``maybe_install_capturing_hooks`` adds to a model's layers at its first forward with
#: ``output_hidden_states``: they append to a collector and return None, changing no output).
LIBRARY_MACHINERY = ("torch", "transformers.utils.output_capturing")


def is_library_machinery(obj: Any) -> bool:
    """Whether ``obj`` (a hook: a function, or an object of a class) is the code of a library's
    own machinery (:data:`LIBRARY_MACHINERY`), left out of keys as :func:`code_identity`
    leaves torch's classes out: it changes no output, and a library may add it at a forward.

    Example:
        >>> is_library_machinery(len)
        False
    """
    owner = getattr(obj, "__module__", None) or type(obj).__module__ or ""
    return any(owner == m or owner.startswith(m + ".") for m in LIBRARY_MACHINERY)


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


def kept_per_object(cache: dict[Any, Any], held: tuple[Any, ...], extra: Any, make: Any) -> Any:
    """``make()``, kept in ``cache`` under the ids of the ``held`` objects (a code object, a
    class) and ``extra``, the objects held beside the value so no id is lent to another object
    while the value is kept. A watch reads what each hook holds at every forward, so what is
    made of a code object (its digest, its globals, its bookkeeping) is made once per object."""
    key = (id(held[0]), extra) if len(held) == 1 else (*map(id, held), extra)
    found = cache.get(key)
    if found is None:
        found = cache[key] = (held, make())
    return found[1]


def bookkeeping_names(code: Any, ops: frozenset[str], cls: type | None = None) -> frozenset[str]:
    """The names a hook's code keeps as its own bookkeeping, left out of keys (neither keyed,
    watched nor refused): those it writes by ``ops`` (``STORE_ATTR``: an attribute,
    ``STORE_DEREF``: a closure cell) or records into in place, and never reads but to compute
    their own new value. A counter (``x += 1``, ``x = x + 1``), a log (``x.append(...)``,
    ``x[k] += v``) and what is only written (an observer's ``self.last = o.mean()``) are
    bookkeeping; a name also read elsewhere, for the output (``o * self.factor`` after
    ``self.factor = float(self.factor)``, a lazy default ``if self.factor is None``), is the
    hook's setting, keyed. The code read is ``code``, the code nested in it and, for a hook
    object of class ``cls``, every method of ``cls`` the code reaches (``self.record(x)``).
    Kept per code object and class (the objects held so their ids are not lent), as a watch
    reads what each hook holds at every forward.

    Example:
        >>> class Hook:
        ...     def __call__(self, x):
        ...         self.record(x)
        ...         self.seen.append(1)
        ...         if self.factor is None:
        ...             self.factor = 1.0
        ...         return x * self.factor
        ...
        ...     def record(self, x):
        ...         self.calls += 1
        ...         self.last = x
        >>> sorted(bookkeeping_names(Hook.__call__.__code__, ATTRIBUTE_WRITES, Hook))
        ['calls', 'last', 'seen']
    """
    return kept_per_object(_BOOKKEEPING, (code, cls), ops, lambda: _bookkeeping(code, ops, cls))


def written_names(code: Any, ops: frozenset[str], cls: type | None = None) -> frozenset[str]:
    """The names ``code`` (as :func:`bookkeeping_names` reads it) writes by ``ops``, records
    into or updates in place, read back or not: a module's forward's own state
    (:class:`HeldReading`'s ``forward``). Kept per code object and class."""
    return kept_per_object(_WRITTEN, (code, cls), ops, lambda: _written(code, ops, cls))


def _written(code: Any, ops: frozenset[str], cls: type | None) -> frozenset[str]:
    """:func:`written_names`, made anew."""
    written: set[str] = set()
    for each in reached_code(code, cls):
        _uses(each, ops, written, set())
    return frozenset(written)


#: written_names's, by code object, class and ops (:func:`kept_per_object`).
_WRITTEN: dict[Any, Any] = {}


def _bookkeeping(code: Any, ops: frozenset[str], cls: type | None) -> frozenset[str]:
    """:func:`bookkeeping_names`, made anew."""
    written: set[str] = set()
    read: set[str] = set()
    for each in reached_code(code, cls):
        _uses(each, ops, written, read)
    return frozenset(written - read)


def _uses(code: Any, ops: frozenset[str], written: set[str], read: set[str]) -> None:
    """Add to ``written`` the names ``code`` (not the code nested in it) writes by ``ops`` or
    records into (:func:`~featbake.keys.records_into`), and to ``read`` those it reads other
    than to compute their own new value: a read counts as such where the name is written
    later in its block (a line, cut at jumps: ``if self.f is None: self.f = 1.0`` reads
    ``f`` for the test)."""
    loads = _READS_OF[ops]
    ins = list(dis.get_instructions(code))
    starts = [i for i, op in enumerate(ins) if op.is_jump_target or op.starts_line]
    starts += [i + 1 for i, op in enumerate(ins) if "JUMP" in op.opname]
    inside = {
        i for end, start in inlined_comprehensions(ins).items() for i in range(start + 1, end + 1)
    }
    bounds = sorted({0, *starts, len(ins)} - inside)
    for lo, hi in itertools.pairwise(bounds):
        block = ins[lo:hi]
        stored = {op.argval for op in block if op.opname in ops}
        written |= stored
        for j, op in enumerate(block, start=lo):
            if op.opname not in loads:
                continue
            if records_into(ins, j) or (ops is GLOBAL_WRITES and _global_updated(ins, j)):
                written.add(op.argval)
            elif op.argval not in stored:
                read.add(op.argval)


#: bookkeeping_names's, by code object, class and ops (:func:`kept_per_object`).
_BOOKKEEPING: dict[Any, Any] = {}


#: The ops by which a hook's code writes an attribute, or a closure cell (``nonlocal``).
ATTRIBUTE_WRITES = frozenset({"STORE_ATTR", "DELETE_ATTR"})
CELL_WRITES = frozenset({"STORE_DEREF", "DELETE_DEREF"})
#: The ops by which a function's code writes a global (``global counter; counter += 1``).
GLOBAL_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL"})
_ATTRIBUTE_READS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_CELL_READS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF"})
#: The ops that read what each kind of write writes.
_READS_OF = {
    ATTRIBUTE_WRITES: _ATTRIBUTE_READS,
    CELL_WRITES: _CELL_READS,
    GLOBAL_WRITES: frozenset({"LOAD_GLOBAL"}),
}
_METHOD_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})

#: Past these a value a hook holds is refused rather than keyed in part: values read in all
#: (each number and string counts), and containers or objects nested in one another.
HELD_VALUES = 512
HELD_DEPTH = 8

#: What a reading past :data:`HELD_VALUES` or :data:`HELD_DEPTH` says of a value.
TOO_LARGE = "a value too large or too deeply nested to key"

#: Values keyed by their value as they are (numpy scalars by their Python value).
_PLAIN_HELD = (bool, int, float, complex, str, bytes, type(None))

_PLAIN_TYPES = frozenset(_PLAIN_HELD)

#: The standard library's value types, keyed by their repr (it names their value and no
#: address): they keep their value in private slots, which no public attribute shows.
_VALUE_TYPES = (
    fractions.Fraction,
    decimal.Decimal,
    PurePath,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    datetime.tzinfo,
    uuid.UUID,
    enum.Enum,
)

#: What threads synchronise by (a recorder's lock, a drain's event): read by their kind.
_SYNC: tuple[type, ...] = (
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Condition,
    threading.Semaphore,
    threading.Barrier,
)
#: Flags threads set (read by whether they are set: a hook may branch on one).
_EVENTS: tuple[type, ...] = (threading.Event,)
try:  # a process's locks, where the platform has them
    import multiprocessing.synchronize as _mp_sync

    _SYNC += (_mp_sync.SemLock, _mp_sync.Condition, _mp_sync.Barrier)
    _EVENTS += (_mp_sync.Event,)
except ImportError:  # pragma: no cover - no sem_open
    pass

#: What a key cannot read: refused where a hook holds one that is not its module's own.
_WEIGHTS = (torch.Tensor, np.ndarray, torch.nn.Module)


class HeldReading:
    """One reading of what a hook holds, by the one rule for a held value: plain values (None,
    bool, numbers, strings, bytes, numpy scalars) by value; tuples, lists, sets and dicts of
    them recursively; a function by its code (:func:`code_digest`), closure cells, defaults
    and what it wraps (``functools.wraps``: ``@torch.no_grad()``); a partial by its function
    and arguments; a bound method by its function and its object; the standard library's value
    types (``Fraction``, ``Decimal``, ``Path``, ``datetime``, ``UUID``, enum members) by their
    repr; a logger by its name, a weak reference by what kind of object it refers to, a
    sentinel ``object()`` as its type; an object by all its attributes, private ones too
    (:func:`instance_attributes`), in ``__dict__`` or ``__slots__``, but those its
    ``__call__`` keeps as bookkeeping (:func:`bookkeeping_names`). A dict (a mappingproxy)
    is read in its order, a deque as a list. Tensors, arrays and modules
    (a bound method of one too) are read as their type, and :attr:`refused` names those not
    in ``own`` (the ids of the hooked module's submodules and tensors, which its key reads),
    as are values past :data:`HELD_VALUES` or :data:`HELD_DEPTH`. A value met again inside
    itself reads as ``<cycle>``. ``exact``: a global module's weights hashed anew
    (:func:`global_module_digest`), as a key and a check before misses read them; else
    trusted while its stamp is unchanged, as a watch reads them at each forward.
    ``tensors``: a tensor or array not in ``own`` read by its values, and a module by its
    state (as global ones are), instead of refused, for a module's own attribute: a
    ``SimpleNamespace``, dataclass or object of its holding global CMVN statistics, or an
    adapter network, changes its outputs as a buffer or submodule does. ``forward``: a
    module's forward read (:func:`forward_globals`): each global against a
    :data:`HELD_VALUES` of its own (a large table left unkeyed leaves the settings beside it
    keyed), and a global the code writes anywhere (``global _warned; _warned = True``, a
    lazily made window, a memo dict it fills, a counter, ``ACC.add_(x)``) is the forward's own
    state, read back or not, as what a forward writes on its own attributes is
    (:func:`~featbake.keys.written_below`): keyed, each run would change the key."""

    def __init__(
        self,
        own: Container[int] = frozenset(),
        exact: bool = False,
        tensors: bool = False,
        written: frozenset[str] = frozenset(),
        forward: bool = False,
    ) -> None:
        self.own = own
        self.exact = exact
        self.tensors = tensors
        self.forward = forward  # a module's forward read: see the class's docstring
        self.written = written  # names a module's forward sets on the objects read here
        #: By the id of a globals dict, the names the functions a module's forward runs set
        #: there (:func:`forward_reads`): its own state, where any of them reads them.
        self.globals_written: dict[int, frozenset[str]] = {}
        #: By the id of a globals dict, the shapes of the names those functions set there by a
        #: name made at run time (:attr:`ForwardState.globals_set_shapes`).
        self.globals_set_shapes: dict[int, frozenset[tuple[str, ...]]] = {}
        self.refused: list[str] = []
        self._path: set[int] = set()
        self._count = 0
        self._globals_read: dict[int, Any] = {}
        self._in_global = 0

    def text(self, value: Any, name: str = "", depth: int = 0) -> str:
        """``value`` as a key reads it (``name``: what holds it, for :attr:`refused`)."""
        self._count += 1
        if self._count > HELD_VALUES or depth > HELD_DEPTH:
            return self._refuse(name, TOO_LARGE)
        if type(value) in _PLAIN_TYPES or isinstance(value, _PLAIN_HELD):
            return repr(value)
        if isinstance(value, np.generic):
            return repr(value.item())
        if id(value) in self._path:
            return "<cycle>"
        self._path.add(id(value))
        try:
            return self._compound(value, name, depth + 1)
        finally:
            self._path.discard(id(value))

    def _items(self, items: Iterable[tuple[Any, ...]], name: str, depth: int) -> list[str]:
        """A container's items (each a value, or a key and its value) as texts, in order,
        the walk stopped at the first past :data:`HELD_VALUES` (refused once, not once per
        item left: a table of 100,000 entries is not read whole to say it is too large)."""
        out = []
        for item in items:
            if self._count >= HELD_VALUES:
                out.append(self._refuse(name, TOO_LARGE))
                break
            out.append(":".join(self.text(part, name, depth) for part in item))
        return out

    def _refuse(self, name: str, what: str) -> str:
        self.refused.append(f"{name or 'a value'} ({what})")
        return f"<{what}>"

    def _weights(self, value: Any, name: str) -> str:
        """A tensor, array or module: the hooked module's own as its type (its key reads
        it); one reached through a global (an adapter object's ``self.net``, a helper's
        closure) or held inside a module's attribute (:attr:`tensors`) by its values or
        state, as a global one is; one the hook holds itself refused (:attr:`refused`: make
        it a buffer or submodule)."""
        what = type(value).__name__
        if id(value) in self.own:
            return f"<{what}>"
        if self.tensors and isinstance(value, torch.nn.Module):
            if isinstance(self.own, _TreeIds) and self.own.inside(value):
                return "<owner>"  # the module holding it, or its owner: the key reads it
            return self._global_module(value, name)  # an adapter in a held namespace
        if self.tensors:
            return self._global_tensor(value, name)
        if not self._in_global:
            return self._refuse(name, what)
        if isinstance(value, torch.nn.Module):
            return self._global_module(value, name)
        return self._global_tensor(value, name)

    def _compound(self, value: Any, name: str, depth: int) -> str:
        if type(value) is types.FunctionType:  # the most common hook, read at each forward
            return self._function(value, name, depth)
        if isinstance(value, functools.partial):
            args = [self.text(a, name, depth) for a in value.args]
            kw = [f"{k}={self.text(v, k, depth)}" for k, v in sorted(value.keywords.items())]
            func = value.func
            library = self._in_global and inspect.isfunction(func) and not followed_helper(func)
            named = f"<{func.__module__}.{func.__qualname__}>" if library else None
            return f"partial({named or self.text(func, name, depth)},{','.join([*args, *kw])})"
        if isinstance(value, _WEIGHTS):
            return self._weights(value, name)
        if isinstance(value, (tuple, list, set, frozenset, collections.deque)):
            items = self._items(((v,) for v in value), name, depth)
            ordered = sorted(items) if isinstance(value, (set, frozenset)) else items
            return f"{type(value).__name__}[{','.join(ordered)}]"
        if isinstance(value, (dict, types.MappingProxyType)):
            rows = self._items(value.items(), name, depth)
            return f"{type(value).__name__}[{','.join(rows)}]"  # in order: a hook may iterate it
        if inspect.ismethod(value):
            return f"method({self._method(value, name, depth)})"
        if inspect.isfunction(value):
            return self._function(value, name, depth)
        if _own_module(value):  # inside a container, an argument: read whole
            return self._module_whole(value, name, depth)
        return self._other(value, name, depth)

    def _method(self, method: Any, name: str, depth: int) -> str:
        """A bound method: its function, and its object (a module: refused unless the hooked
        module's own, whose key reads it; another object: its attributes but those the
        function keeps as bookkeeping)."""
        func, obj = method.__func__, method.__self__
        code = self.text(func, name, depth)
        if isinstance(obj, torch.nn.Module) and self._in_global and id(obj) not in self.own:
            return f"{code},{self._global_module(obj, name)}"
        if isinstance(obj, torch.nn.Module):
            what = f"a method of the module {type(obj).__qualname__}"
            held = "<own>" if id(obj) in self.own else self._refuse(name, what)
            return f"{code},{held}"
        if isinstance(obj, logging.Logger):
            return f"{code},{self._other(obj, name, depth)}"
        if isinstance(obj, type):  # a class method: the class's settings it reads (cls.GAIN)
            return f"{code},{self._class_reads(obj, unwrapped(func), {}, depth)}"
        return f"{code},{self._attributes(obj, func, depth)}"

    def _function(self, func: Any, name: str, depth: int) -> str:
        """A function: its code, its closure cells (an empty one ``<empty>``) but those it
        keeps as bookkeeping, its defaults and keyword defaults, and the function it wraps."""
        own = bookkeeping_names(func.__code__, CELL_WRITES) if func.__closure__ else frozenset()
        parts = [cached_code_digest(func.__code__)]
        code = [func.__code__]
        for cell_name, cell in zip(func.__code__.co_freevars, func.__closure__ or (), strict=False):
            if cell_name not in own:
                try:
                    held = cell.cell_contents
                except ValueError:
                    parts.append("<empty>")
                    continue
                parts.append(self._held(held, name, cell_name, ("cell", cell_name), code, depth))
        defaults = func.__defaults__ or ()
        named = func.__code__.co_varnames[: func.__code__.co_argcount][-len(defaults) :]
        for arg, v in zip(named if defaults else (), defaults, strict=True):
            parts.append(self._held(v, name, arg, ("param", arg), code, depth))
        for k, v in sorted((func.__kwdefaults__ or {}).items()):
            parts.append(f"{k}={self._held(v, k, k, ('param', k), code, depth)}")
        wrapped = getattr(func, "__wrapped__", None)
        if wrapped is not None:
            parts.append(f"wraps={self.text(wrapped, name, depth)}")
        parts += self._globals(func, depth)
        return f"function({','.join(parts)})"

    def class_settings(self, cls: type, func: Any, shadowed: frozenset[str]) -> str:
        """The data ``cls`` holds that ``func`` and the methods of ``cls`` it reaches read
        as ``self.K`` or ``cls.K`` (:func:`class_data_names`, as :meth:`_class_reads` reads a
        hook object's), none of ``shadowed`` (names its instances hold themselves); ``""``
        where it reads none."""
        rows = self._class_rows(cls, class_data_names(cls, func), shadowed, 0)
        return f"class[{','.join(rows)}]" if rows else ""

    def globals_read(self, func: Any) -> list[str]:
        """The globals ``func``'s code reads, each as ``global name=text``
        (:meth:`_globals`): what a module's forward reads beside its own state
        (:func:`forward_globals`)."""
        return self._globals(func, 0)

    def _globals(self, func: Any, depth: int) -> list[str]:
        """The globals a function's code reads (:func:`global_names`) that change what it
        does, each by :meth:`_global`, and what it reads through the user's own modules and
        classes by name (:func:`attribute_chains`: ``utils.apply_gain``, ``Config.GAIN``,
        ``AudioUtils.normalise``), and of the process's settings in the standard library
        (:data:`PROCESS_SETTINGS`: ``os.environ``, ``os.getenv``, ``sys.argv``), each under its
        dotted name, as a global of that name would be. Other modules, classes and callables
        (library code) are code, read by the code rule, never here. A global the code keeps as
        bookkeeping (:func:`bookkeeping_names` by ``STORE_GLOBAL``: a counter it bumps, a list
        or queue it only records into) is left out, as a hook's attribute or cell is; a
        container or object read whole by several functions of one hook is read (and counted
        toward :data:`HELD_VALUES`) once."""
        found = getattr(func, "__globals__", {})
        code = func.__code__
        asked = globals_asked(code)
        kept = bookkeeping_names(code, GLOBAL_WRITES) - asked.read  # globals()["K"] reads it
        if self.forward:  # the forward's own state, read back or not
            kept |= written_names(code, GLOBAL_WRITES) | asked.written
            kept |= self.globals_written.get(id(found), frozenset())
        rows = []
        shapes = self.globals_set_shapes.get(id(found), frozenset()) if self.forward else None
        named = globals_named(func, shapes or frozenset())
        for g in named:
            value = found.get(g, _ABSENT)
            if value is not _ABSENT and g not in kept:
                text = self._global(g, value, code, depth, found)
                rows += [] if text is None else [f"global {g}={text}"]
            elif g in asked.read and g not in kept:  # globals().get("K", 1.0): gained later
                rows.append(f"global {g}=<absent>")
        reached, wholes = self._reached_by_chains(code, found, kept)
        importers = any(
            _holds_importer(found[g])
            for g in named
            if g in found and g not in kept and g not in _IMPORTERS  # those: read at the call
        )
        refusals = _root_reads(code, found, kept, reached, wholes)
        for what in sorted(refusals | ({IMPORTED_AT_RUN_TIME} if importers else set())):
            rows.append(self._refuse(code.co_name, what))
        for name, value in sorted(reached.items()):
            text = self._global(name, value, code, depth, found)
            rows += [] if text is None else [f"global {name}={text}"]
        for name, module in sorted(wholes.items()):
            rows.append(f"global {name}={self._module_whole(module, name, depth)}")
        return rows

    def _reached_by_chains(
        self, code: Any, found: Mapping[str, Any], kept: Container[str]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """What ``code`` (globals ``found``, its own state ``kept``) reaches by attributes of
        a global (:func:`attribute_chains`), by dotted name: the settings of the user's
        modules and classes and the process's it reads, a function of the user's a library
        module holds (``F.gelu = my_gelu``: :func:`patched_in_library`); and the user's
        modules it passes on or keeps, read whole."""
        reached: dict[str, Any] = {}
        wholes: dict[str, Any] = {}
        for g, chain in attribute_chains(code):
            if g in kept or g not in found:
                continue
            if leads_on(found[g], chain[0]):
                name, value = reached_attribute(g, found[g], chain)
                if _own_module(value):
                    wholes.setdefault(name, value)  # passed on or kept: read whole
                elif name != g and value is not _ABSENT and not self._own_state(code, name):
                    reached.setdefault(name, value)
            else:  # F.gelu = my_gelu: the user's code runs
                name, patched = patched_in_library(g, found[g], chain)
                reached.update({name: patched} if patched is not None else {})
        return reached, wholes

    def _own_state(self, code: Any, dotted: str) -> bool:
        """Whether the global reached at ``dotted`` is the code's own bookkeeping: only
        recorded into (:func:`only_recorded`), or, in a forward's reading, recorded into or
        set anywhere (:func:`recorded_at_all`: ``shared.CACHE[key] = w`` beside ``key in
        shared.CACHE``)."""
        return only_recorded(code, dotted) or (self.forward and recorded_at_all(code, dotted))

    def _module_whole(self, module: types.ModuleType, name: str, depth: int) -> str:
        """A module of the user's that code passes on or keeps where no reading follows it
        (``helper(config)``, ``self.cfgs = [config]``): every setting it holds (its globals
        that are data: no module, class or callable) by value, as globals are read; once per
        reading."""
        if self._read_before(module):
            return "<read above>"
        self._in_global += 1
        try:
            rows = [
                f"{k}={self.text(v, f'{name}.{k}', depth + 1)}"
                for k, v in sorted(vars(module).items())
                if not k.startswith("__") and is_data(v)
            ]
        finally:
            self._in_global -= 1
        return f"module({','.join(rows)})"

    def _held(
        self, value: Any, name: str, label: str, root: Any, codes: list[Any], depth: int
    ) -> str:
        """A value a function or object holds (a cell, a default, an attribute: ``root`` as
        :func:`root_chains` names it, ``codes`` the code that reads it): a module of the
        user's by what the code reads of it, each attribute as a global of that dotted name
        (``cfg.GAIN``), or whole where the code uses it otherwise or not at all; any other
        value as it is (:meth:`text`, ``name`` what holds it). ``label``: the name the code
        gives it."""
        if not _own_module(value):
            return self.text(value, name, depth)
        chains = {c for code in codes for r, c in root_chains(code) if r == root}
        if not chains or ("*",) in chains:
            return self._module_whole(value, label, depth)
        reached: dict[str, Any] = {}
        wholes: dict[str, Any] = {}
        for chain in chains:
            _reach(label, value, chain, reached, wholes, absent=True)
        rows = []
        for name, found in sorted(reached.items()):
            text = "<absent>" if found is _ABSENT else self._global(name, found, codes[0], depth)
            rows += [] if text is None else [f"{name}={text}"]
        rows += [f"{n}={self._module_whole(m, n, depth)}" for n, m in sorted(wholes.items())]
        return f"module({','.join(rows)})"

    def _global(
        self, name: str, value: Any, code: Any, depth: int, where: Mapping[str, Any] | None = None
    ) -> str | None:
        """A global the code reads under ``name`` (dotted where reached through a module or
        class), as a key reads it, or None where it is code (read by the code rule):
        ``os.environ`` (or ``os.getenv``) read only by constant names by those variables
        (:func:`names_read`), else whole; a tensor or array by its values
        (:func:`global_tensor_digest`); plain data (a script's ``args``, a settings dict) by
        its value, only the items or fields the code names where it reads no other
        (:meth:`_fields_read`); a module (an adapter) by its state (:meth:`_global_module`);
        the user's own code it calls (:func:`followed_helper`: a function, a partial or bound
        method of one, a callable object of the user's class) as a held one is read, its own
        globals in turn, so a setting a helper reads is keyed as one the hook reads (recursion
        reads as ``<cycle>``, a chain past :data:`HELD_DEPTH` is refused); a library function
        bound otherwise than its file binds it (:func:`library_bound_anew`; ``where``: the
        globals of the code reading it). A tensor or module met inside what a global holds is
        keyed as a global one (:meth:`_weights`)."""
        fresh = self.forward and not self._in_global
        counted, self._count = self._count, 0 if fresh else self._count
        self._in_global += 1
        try:
            return self._global_value(name, value, code, depth, where)
        finally:
            self._in_global -= 1
            self._count = counted if fresh else self._count

    def _global_value(
        self, name: str, value: Any, code: Any, depth: int, where: Mapping[str, Any] | None
    ) -> str | None:
        """:meth:`_global`, inside the count of globals being read."""
        if value is os.environ or value is os.getenv:
            how = Read.BY_KEY if value is os.environ else Read.BY_ARGUMENT
            names = names_read(code, name, how)
            if names is not None:
                return self.text({n: os.environ.get(n) for n in names}, name, depth)
            value = os.environ
        if isinstance(value, (torch.Tensor, np.ndarray)):
            return self._global_tensor(value, name)
        if is_data(value):
            fields = self._fields_read(value, name, code, depth)
            if fields is not None:
                return fields
            return "<read above>" if self._read_before(value) else self.text(value, name, depth)
        if isinstance(value, torch.nn.Module):
            return self._global_module(value, name)
        if inspect.ismethod(value) and isinstance(value.__self__, torch.nn.Module):
            return self.text(value, name, depth)  # model.forward: the module by its state
        helper = followed_helper(value)
        if helper is None:
            return library_bound_anew(name, value, where)
        if isinstance(helper, (types.FunctionType, functools.partial, types.MethodType)):
            return self.text(helper, name, depth)
        runs = unwrapped(_runs(helper))  # a callable object: its __call__'s code, what it holds
        return f"call({cached_code_digest(runs.__code__)},{self.text(helper, name, depth)})"

    def _fields_read(self, value: Any, name: str, code: Any, depth: int) -> str | None:
        """A global dict the code reads only by constant keys (``CFG["gain"]``,
        ``CFG.get("gain", 1.0)``, ``"gain" in CFG``) as those items (one absent as
        ``<absent>``), an object only by its attributes' names (``args.gain``) as those
        fields, by value (:func:`names_read`): an instance attribute, a class default
        (``DEFAULTS.gain`` set on the class), a method of the user's class as a bound method
        (its code, the object's attributes and the globals it reads: ``NORMALISER.apply``);
        None where the code reads it otherwise (passes it on, iterates it, names a key built
        at run time, a property, a library method): then it is read whole. A run with another
        learning rate keeps the key of a hook that reads ``args.gain``, and a namespace listing 600
        input files is no value too large."""
        if type(value) is dict:
            keys = names_read(code, name, Read.BY_KEY)
            if keys is None:
                return None
            rows = [
                f"{self.text(k, name, depth)}:"
                + (self.text(value[k], name, depth) if k in value else "<absent>")
                for k in keys
            ]
            return f"dict[{','.join(rows)}]"
        if not _plain_object(value):
            return None
        fields = names_read(code, name, Read.BY_FIELD)
        if fields is None:
            return None
        held = dict(instance_attributes(value))
        rows = []
        cached = cached_names(type(value))
        for f in fields:
            if f in self.written:
                continue  # the module's forward sets it: derived state
            if f in held and f not in cached:
                rows.append(f"{f}={self.text(held[f], f, depth)}")
                continue
            found = namespace_attribute(type(value), f)  # a class default, a method
            raw = inspect.getattr_static(type(value), f, None)
            if isinstance(raw, functools.cached_property):
                found = raw.func  # its value is made from the rest by its code
            if type(found) is types.FunctionType and followed_helper(found) is not None:
                rows.append(f"{f}={self.text(types.MethodType(found, value), f, depth)}")
            elif inspect.ismethod(found) and followed_helper(found) is not None:
                rows.append(f"{f}={self.text(found, f, depth)}")  # a class method
            elif found is not _ABSENT and is_data(found):
                rows.append(f"{f}={self.text(found, f, depth)}")
            else:
                return None  # a property, a library method: read whole
        return f"{type(value).__qualname__}({','.join(rows)})"

    def _global_tensor(self, value: torch.Tensor | np.ndarray, name: str) -> str:
        """A tensor or array the code reads as a global (a window, a mean and std), by its
        values (:func:`global_tensor_digest`); the hooked module's own as ``<own>`` (its key
        reads it); an array of Python objects, whose bytes are addresses, and a tensor with no
        dense bytes of its own (sparse, meta, quantized, nested) refused."""
        if id(value) in self.own:
            return "<own>"
        if isinstance(value, np.ndarray) and value.dtype.hasobject:
            return self._refuse(name, "an array of Python objects")
        if isinstance(value, torch.Tensor) and not _dense(value):
            return self._refuse(name, "a sparse, meta, quantized or nested tensor")
        exact = self.exact or _hashed_at_each_read(value)
        return f"{type(value).__name__}({global_tensor_digest(value, exact=exact)})"

    def _read_before(self, value: Any) -> bool:
        """Whether ``value``, a global's container or object (no plain value: those cost one
        each and one object may be many names' in a process and not in another), was read in
        this reading already; marked read if not."""
        if type(value) in _PLAIN_TYPES:
            return False
        if id(value) in self._globals_read:
            return True
        self._globals_read[id(value)] = value  # held: its id is not lent while reading
        return False

    def _global_module(self, module: torch.nn.Module, name: str) -> str:
        """A module a hook's code (or a helper's) reads as a global, by its state
        (:func:`global_module_digest`: its class, code, attributes, mode and every parameter
        and buffer by value); the hooked module's own as ``<own>`` (its key reads it). One with
        forward hooks of its own (but library machinery) is refused: its hooks would be read
        inside the hooked module's, and a submodule's are keyed as the module's."""
        if id(module) in self.own:
            return "<own>"
        if any(not is_library_machinery(h) for _, _, h in forward_hooks(module)):
            what = f"the module {type(module).__qualname__}, which has forward hooks of its own"
            return self._refuse(name, what)
        moded = mode_dependent_submodule(module)
        if moded is not None:
            what = f"the module {type(module).__qualname__} {IN_TRAIN_MODE} ({moded})"
            return self._refuse(name, what)
        return f"module({global_module_digest(module, exact=self.exact)})"

    def _other(self, value: Any, name: str, depth: int) -> str:
        """A class or module by its name (the script run's as ``__main__``'s in a spawned
        worker too, as :func:`hook_code` names it), a logger by its name (one per name in a
        process, it changes no output), a hook's handle (``register_forward_hook``'s, kept to
        remove the hook: its ``id`` counts the hooks the process registered before) as one, a
        lock, condition, semaphore, event or barrier by its kind (threads meet by it; it
        changes no output), a
        builtin function by its name and object, an enum member or a value with no attributes
        by its repr (``torch.float16``), an object by its public attributes. One with no
        attributes whose repr is its address (the default one)
        is refused: an address is no value, and another in each process."""
        if isinstance(value, logging.Logger):
            return f"<logger {value.name}>"
        if isinstance(value, weakref.ref):  # changes no output by itself: what it refers to
            return f"<weakref {type(value()).__qualname__}>"
        if isinstance(value, RemovableHandle):  # its id counts the process's hooks so far
            return "<hook handle>"
        if isinstance(value, _EVENTS):  # a switch a hook may branch on: by its flag
            flag: Any = value
            return f"<{type(value).__qualname__} set={flag.is_set()}>"
        if isinstance(value, _SYNC):  # a lock a recorder takes: it changes no output
            return f"<{type(value).__qualname__}>"
        if type(value) is object:  # a sentinel default
            return "<object>"
        if isinstance(value, _VALUE_TYPES):
            return f"{type(value).__qualname__}:{value!r}"
        if isinstance(value, (type, types.ModuleType)):
            qualname = getattr(value, "__qualname__", value.__name__)
            owner = getattr(value, "__module__", "")
            return f"<{'__main__' if owner == '__mp_main__' else owner}.{qualname}>"
        if isinstance(value, types.BuiltinFunctionType):
            obj = value.__self__
            plain = obj is None or isinstance(obj, types.ModuleType)
            held = "" if plain else self.text(obj, name, depth)
            return f"builtin({value.__qualname__},{held})"
        if isinstance(value, enum.Enum) or not _has_attributes(value):
            text = repr(value)
            if " at 0x" in text:
                return self._refuse(name, f"{type(value).__qualname__}, keyed by its address")
            return f"{type(value).__qualname__}:{text}"
        return self._attributes(value, _runs(value), depth)

    def _attributes(self, obj: Any, runs: Any, depth: int) -> str:
        """An object's attributes but those the code ``runs`` keeps as bookkeeping, and the
        globals ``runs`` and the methods of the object's class it reaches read
        (:func:`reached_methods`: ``self.scale(x)`` reading a global config)."""
        runs = unwrapped(runs) if inspect.isfunction(runs) else runs  # @torch.no_grad()
        code = getattr(runs, "__code__", None)
        cls = type(obj)
        own = bookkeeping_names(code, ATTRIBUTE_WRITES, cls) if code is not None else frozenset()
        own |= cached_names(cls)  # made from the rest by code the key reads
        own |= self.written  # the module's forward sets them: derived state
        held = dict(instance_attributes(obj))
        methods = reached_methods(runs, cls) if inspect.isfunction(runs) else ()
        codes = [f.__code__ for f in methods]
        rows = [
            f"{k}={self._held(v, k, k, ('self', k), codes, depth)}"
            for k, v in held.items()
            if k not in own
        ]
        if inspect.isfunction(runs):
            rows += [self._class_reads(cls, runs, held, depth)]
            for func in methods:
                rows += self._globals(func, depth)
        return f"{type(obj).__qualname__}({','.join(rows)})"

    def _class_reads(self, cls: type, runs: Any, held: dict[str, Any], depth: int) -> str:
        """The class attributes ``runs`` and the methods of ``cls`` it reaches may read as
        ``self.scale`` or ``cls.GAIN`` (names they load) that hold data and no instance
        attribute in ``held`` shadows: a hook object's or transform's setting kept on its
        class, by value."""
        return f"class[{','.join(self._class_rows(cls, loaded_names(runs, cls), held, depth))}]"

    def _partialmethod(self, method: functools.partialmethod[Any], name: str, depth: int) -> str:
        """A ``functools.partialmethod`` a class holds: the function it calls by its code
        (what it reads is read as a method the forward runs: :func:`functions_held`), and the
        arguments it binds by value (``partialmethod(_run, scale=2.0)`` set anew with
        ``scale=3.0`` changes what the forward returns)."""
        func = method.func
        if isinstance(func, functools.partialmethod):
            called = self._partialmethod(func, name, depth)
        else:
            inner = method_function(func)
            code = getattr(inner, "__code__", None)
            called = cached_code_digest(code) if code is not None else self.text(func, name)
        args = [self.text(a, name, depth) for a in method.args]
        kw = [f"{k}={self.text(v, k, depth)}" for k, v in sorted(method.keywords.items())]
        return f"partialmethod({called},{','.join([*args, *kw])})"

    def _class_rows(
        self, cls: type, names: Iterable[str], shadowed: Container[str], depth: int
    ) -> list[str]:
        """``name=text`` for each of ``names`` that ``cls`` holds data under (no method,
        class or descriptor) and no instance attribute in ``shadowed`` shadows. What a class
        holds is every instance's, as a global is: a tensor or array by its values (a window
        edited in place, ``Cls.WINDOW.mul_(2)``), a module by its state."""
        rows = []
        self._in_global += 1
        try:
            for n in names:
                raw = _ABSENT if n in shadowed else inspect.getattr_static(cls, n, _ABSENT)
                if isinstance(raw, functools.partialmethod):
                    rows.append(f"{n}={self._partialmethod(raw, n, depth)}")
                    continue
                found = _ABSENT if raw is _ABSENT else class_value(cls, raw)
                if found is not _ABSENT and is_data(found) and not isinstance(found, type):
                    rows.append(f"{n}={self.text(found, n, depth)}")
                elif found is not _ABSENT:
                    swapped = class_library_bound_anew(cls, n, raw)
                    rows += [] if swapped is None else [f"{n}={swapped}"]
        finally:
            self._in_global -= 1
        return rows


def reached_methods(func: Any, cls: type) -> tuple[Any, ...]:
    """``func`` and every function of ``cls`` (its methods, property getters) its code
    reaches by name (:func:`~featbake.keys.reached_code`), each once; kept per code object
    and class."""
    return tuple(
        kept_per_object(_METHODS, (func.__code__, cls), None, lambda: _reached_methods(func, cls))
    )


def _reached_methods(func: Any, cls: type) -> list[Any]:
    """:func:`reached_methods`, made anew."""
    codes = reached_code(func.__code__, cls)
    found = [func]
    for klass in cls.__mro__:
        for attr in vars(klass).values():
            method = method_function(attr)
            reached = inspect.isfunction(method) and any(method.__code__ is c for c in codes)
            if reached and all(method is not f for f in found):
                found.append(method)
    return found


#: reached_methods's, by code object and class (:func:`kept_per_object`).
_METHODS: dict[Any, Any] = {}


def class_data_names(cls: type, func: Any) -> tuple[str, ...]:
    """The names ``func`` and the methods of ``cls`` it reaches load (:func:`loaded_names`)
    that ``cls`` has (data, a method, a property: one may be bound to data later): what a
    watch looks up on the class at each forward, found once per code object, class and
    :func:`class_layout` (a forward loads thirty names, ``stft`` and ``matmul`` among them,
    and looking each up on the class cost 0.6 ms a call). A name the class gains later
    (``getattr(self, "K", 1.0)`` with ``Cls.K`` set after the first read) or loses changes
    its layout, so the names are found again."""
    return tuple(
        kept_per_object(
            _CLASS_DATA,
            (func.__code__, cls),
            class_layout(cls),
            lambda: [
                n
                for n in _names_loaded_or_picked(func, cls)
                if inspect.getattr_static(cls, n, _ABSENT) is not _ABSENT
            ],
        )
    )


def _names_loaded_or_picked(func: Any, cls: type) -> list[str]:
    """:func:`loaded_names`, the names the user's classes hold that a name ``func`` picks
    an attribute by at run time fits (:class:`RunTimePicks`), and ``forward`` or ``__call__``
    where ``cls`` holds a ``partialmethod`` there (its arguments are settings), sorted."""
    loaded = set(loaded_names(func, cls))
    loaded |= picks_at_run_time(func, cls).names(cls)
    entries = ("forward", "__call__")  # run by the module's call: no code names them
    loaded |= {n for n in entries if isinstance(vars(cls).get(n), functools.partialmethod)}
    return sorted(loaded)


def class_layout(cls: type) -> tuple[Any, ...]:
    """A hash of the names each class of the user's in ``cls``'s MRO holds, and how many
    each library class holds: what changes where a class gains a name or loses one (``Cls.K
    = 3.0`` set where it had none, ``del Cls.K``, both at once), read in about a microsecond
    at each forward (a user's class holds a few dozen names; ``nn.Module`` a hundred,
    counted). A hash, not the names: kept as a cache's key, a class gaining a name per
    window length would keep every layout's names."""
    return tuple(hash(tuple(vars(k))) if mine else len(vars(k)) for k, mine in _own_in_mro(cls))


def _own_in_mro(cls: type) -> list[tuple[type, bool]]:
    """Each class of ``cls``'s MRO, and whether it is the user's (not library code); kept per
    class, read again where its ``__bases__`` were set since."""
    mro = cls.__mro__
    kept = _OWN_IN_MRO.get(cls)
    if kept is None or kept[0] is not mro:
        kept = _OWN_IN_MRO[cls] = (mro, tuple(not is_library_code(k) for k in mro))
    return list(zip(mro, kept[1], strict=True))


#: class -> its MRO and which of its classes are the user's (_own_in_mro's).
_OWN_IN_MRO: weakref.WeakKeyDictionary[type, tuple[tuple[type, ...], tuple[bool, ...]]] = (
    weakref.WeakKeyDictionary()
)


#: class_data_names's, by code object and class (:func:`kept_per_object`).
_CLASS_DATA: dict[Any, Any] = {}


def loaded_names(func: Any, cls: type) -> tuple[str, ...]:
    """The attribute names ``func`` and the methods of ``cls`` it reaches load (``self.scale``,
    ``cls.GAIN``), sorted: where a class attribute may be read. Kept per code object and
    class."""
    return tuple(
        kept_per_object(_LOADED, (func.__code__, cls), None, lambda: _loaded_names(func, cls))
    )


def _loaded_names(func: Any, cls: type) -> list[str]:
    """:func:`loaded_names`, made anew: each attribute loaded, and each name a
    ``getattr(self, "K", 1.0)`` or ``hasattr(self, "K")`` asks by a constant."""
    loads = (op for code in reached_code(func.__code__, cls) for op in dis.get_instructions(code))
    names = {str(op.argval) for op in loads if op.opname in _METHOD_LOADS}
    return sorted(names.union(names_asked(func, cls), helpers_attribute_names(func)))


@dataclass(frozen=True, eq=False)
class LaterRead:
    """A ``(class, function)`` pair of a module's forward that reads no setting now but may
    later (:func:`later_read`), and what a watch glances at for it at each forward, in about
    a microsecond where a reading costs about 0.1 ms: the class's layout where the code asks
    a name by ``getattr(self, "K", 1.0)`` the class may gain (:func:`names_asked`), and the
    objects the globals bound to library functions hold, directly or through the user's
    modules (a script may bind ``models.ACT = torch.tanh`` or ``ops.gelu = torch.tanh``:
    :func:`library_bound_anew`)."""

    cls: type
    func: Any
    asks: bool
    functions: tuple[tuple[str, ...], ...]  # each a global and the attributes after it

    def now(self) -> tuple[Any, ...]:
        """What the glance compares: the layout, and the functions bound (held, by
        identity)."""
        found = self.func.__globals__
        layout = class_layout(self.cls) if self.asks else ()
        return (layout, tuple(_looked_up(found, path) for path in self.functions))


def _looked_up(found: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The object at ``path`` (a global, then attributes) in the globals ``found``."""
    value = found.get(path[0])
    for part in path[1:]:
        value = getattr(value, part, None)
    return value


def later_read(cls: type, func: Any) -> LaterRead | None:
    """The :class:`LaterRead` of ``func`` (a forward of ``cls``, or a method it runs), or
    None where it may read no setting later (a library's method: its bindings are its
    version's)."""
    if is_library_code(func):
        return None
    functions = tuple(
        dict.fromkeys(
            tuple(name.split("."))
            for name, v in reached_by_globals(func)
            if callable(v) and not isinstance(v, (type, types.ModuleType))
        )
    )
    asks = bool(names_asked(func, cls)) or bool(picks_at_run_time(func, cls))
    return LaterRead(cls, func, asks, functions) if asks or functions else None


def names_asked(func: Any, cls: type) -> tuple[str, ...]:
    """The names ``func`` and the methods of ``cls`` it reaches ask by ``getattr(self, "K",
    1.0)`` or ``hasattr(self, "K")``: settings a class may gain after a watch planned what
    to read (a forward reading none now reads one once ``Cls.K`` is set). Kept per code
    object and class."""
    return tuple(
        kept_per_object(_ASKED, (func.__code__, cls), None, lambda: _names_asked(func, cls))
    )


def _names_asked(func: Any, cls: type) -> list[str]:
    """:func:`names_asked`, made anew."""
    names: set[str] = set()
    for code in reached_code(func.__code__, cls):
        ins = list(dis.get_instructions(code))
        names.update(n for i in range(len(ins)) if (n := _asked_by_name(ins, i)) is not None)
    return sorted(names)


#: names_asked's, by code object and class (:func:`kept_per_object`).
_ASKED: dict[Any, Any] = {}


def _asked_by_name(ins: list[Any], i: int) -> str | None:
    """The constant name ``getattr(obj, "K"[, default])`` or ``hasattr(obj, "K")`` at
    ``ins[i]`` (the load of ``getattr`` or ``hasattr``) asks of a local or global ``obj``
    (``self``), or None."""
    if ins[i].opname != "LOAD_GLOBAL" or ins[i].argval not in ("getattr", "hasattr"):
        return None
    after = ins[i + 1 : i + 3]
    if [o.opname for o in after][:1] not in (["LOAD_FAST"], ["LOAD_DEREF"], ["LOAD_GLOBAL"]):
        return None
    named = after[1].argval if len(after) == 2 and after[1].opname == "LOAD_CONST" else None
    return named if isinstance(named, str) else None


def picks_at_run_time(func: Any, cls: type) -> RunTimePicks:
    """What ``func`` or a method of ``cls`` it reaches, or a helper of the user's it calls
    (:func:`helpers_reached`: ``_pick(self, x)``, given the module), asks its object or class
    for by a name made at run time (``getattr(self, "forward_" + self.mode)``,
    ``getattr(type(self), f"_{self.kind}_head")``, ``hasattr(self, name)``): the methods and
    settings of the user's classes whose names fit may then be read. Kept per code object
    and class."""
    return kept_per_object(_PICKS, (func.__code__, cls), None, lambda: _run_time_picks(func, cls))


def _run_time_picks(func: Any, cls: type) -> RunTimePicks:
    """:func:`picks_at_run_time`, made anew."""
    codes = (func.__code__, *(h.__code__ for h in helpers_reached(func)))
    found = [p for code in codes for p in _picks(code, cls)]
    held = frozenset(s for s, on_held in found if on_held)  # its own class's fitting too:
    return RunTimePicks(frozenset(s for s, _ in found), held)  # self.__class__.__mro__[0]


@dataclass(frozen=True)
class RunTimePicks:
    """The shapes of the names a function picks attributes of its object or class by, made
    at run time: each the constant parts of one name in their order (``("forward_",)`` for
    ``"forward_" + self.mode``, ``("_", "_head")`` for ``f"_{self.kind}_head"``), ``()``
    where no part is known (``getattr(self, name)``): any name fits that one; ``held``, those
    of the names picked on an object it holds (``getattr(self.heads, "fast_" + mode)``),
    whose class, in the module's tree, runs the methods that fit (:func:`calls_in`).
    False where none is picked."""

    shapes: frozenset[tuple[str, ...]] = frozenset()
    held: frozenset[tuple[str, ...]] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.shapes or self.held)

    def names(self, cls: type, *, any_name: bool = True) -> frozenset[str]:
        """The names the user's classes in ``cls``'s MRO hold (:func:`own_names`) that a
        pick's shape fits; with ``any_name`` false, those of shapes that tell a name apart
        only (:func:`telling`: what a pick of any name reaches is read, never taken as the
        forward's own state: a setter beside it, ``cls.scale = s``, sets a setting)."""
        if any_name:
            return _fitting(own_names(cls), self.shapes, True)
        return _fitting(own_names(cls), [s for s in self.shapes if telling(s)], False)


def telling(shape: tuple[str, ...]) -> bool:
    """Whether ``shape`` tells the names it fits apart from others: it begins with a
    constant holding a letter or digit (``"h_" + k``), or holds one of two (``"forward_"``
    anywhere); ``f"{a}_{b}"`` (only ``"_"`` known) fits ``set_scale`` as well as ``avg_big``."""
    head = shape[0] if shape and shape[0] != _ANY_TEXT else ""
    alnum = [sum(c.isalnum() for c in p) for p in shape if p != _ANY_TEXT]
    return any(c.isalnum() for c in head) or any(n >= 2 for n in alnum)


def _fitting(
    names: Iterable[str], shapes: Iterable[tuple[str, ...]], any_name: bool
) -> frozenset[str]:
    """The ``names`` a shape fits (:func:`_fits`); shapes of no known part only where
    ``any_name``."""
    kept = [s for s in shapes if known_part(s) or any_name]
    return frozenset(n for n in names if any(_fits(n, s) for s in kept))


def _fits(name: str, shape: tuple[str, ...]) -> bool:
    """Whether ``name`` is a text of ``shape`` (its parts in order, :data:`_ANY_TEXT` any
    text): ``forward_fast`` of ``("forward_", _ANY_TEXT)``; any name of a shape with no
    part known."""
    if not known_part(shape):
        return True
    pattern = "".join(".*" if p == _ANY_TEXT else re.escape(p) for p in shape)
    return re.fullmatch(pattern, name, re.DOTALL) is not None


def known_part(shape: tuple[str, ...]) -> bool:
    """Whether ``shape`` holds a constant part (a name of it is known in part)."""
    return any(p != _ANY_TEXT for p in shape)


#: picks_at_run_time's, by code object and class (:func:`kept_per_object`).
_PICKS: dict[Any, Any] = {}


def _picks(code: Any, cls: type) -> list[tuple[tuple[str, ...], bool]]:
    """The picks of ``code`` and the methods of ``cls`` it reaches (:func:`_picked_at`),
    made anew."""
    found: list[tuple[tuple[str, ...], bool]] = []
    for each in reached_code(code, cls):
        if "getattr" not in each.co_names and "hasattr" not in each.co_names:
            continue
        ins = list(dis.get_instructions(each))
        found += [p for i in range(len(ins)) if (p := _picked_at(each, ins, i)) is not None]
    return found


def _picked_at(code: Any, ins: list[Any], i: int) -> tuple[tuple[str, ...], bool] | None:
    """The shape of the name (:class:`RunTimePicks`) where ``ins[i]`` loads ``getattr`` or
    ``hasattr`` called on the code's object or class (:func:`_own_object_end`), or on an
    object it holds (``getattr(self.heads, mode)``: then True beside it), with a name that is
    no constant; None where it loads something else or the name is a constant."""
    if ins[i].opname != "LOAD_GLOBAL" or ins[i].argval not in ("getattr", "hasattr"):
        return None
    j = _own_object_end(code, ins, i + 1)
    held = False
    while j is not None and j < len(ins) and ins[j].opname in _METHOD_LOADS:
        j, held = j + 1, True  # no name begins by an attribute: self.heads is the object
    if j is None or _constant_argument(ins, j) is not None:
        return None
    return _name_shape(ins, j), held


def _name_shape(ins: list[Any], j: int) -> tuple[str, ...]:
    """The shape (:class:`RunTimePicks`) of the name argument starting at ``ins[j]``, up to
    the call it is passed to (the first call, or 3.11's ``PRECALL``, of two or three
    arguments where the name, and a default, are what the argument left on the stack). The
    argument is followed value by value (:func:`_shape_after`): a constant string is a part
    only where it is added to the name (``"forward_" + self.mode``) or joined into an
    f-string; one read otherwise (a key, ``self.cfg["mode"]``; a format spec; a default;
    ``"{}_head".format(k)``, ``"%s" % k``: what a call or another operator makes is any
    text) makes no part. ``()`` where the name has no part known, or an instruction it does
    not follow builds it: any name may be asked."""
    stack: list[tuple[str, ...] | None] = []
    for op in ins[j:]:
        if op.opname in ("PRECALL", "CALL") and op.arg in (2, 3) and len(stack) == op.arg - 1:
            shape = stack[0] or ()
            return shape if known_part(shape) else ()
        if not _shape_after(op, stack):
            return ()
    return ()


#: The loads of one value (a global's NULL beside it, 3.11) a name may be built of.
_VALUE_LOADS = frozenset(
    {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME"}
)
#: A part of a shape no constant fills (:func:`_name_shape`): any text.
_ANY_TEXT = "\0"


def _shape_after(op: Any, stack: list[tuple[str, ...] | None]) -> bool:
    """Follow ``op`` on a stack of shapes (a tuple of parts, :data:`_ANY_TEXT` for text
    not known; None for no string), or False where ``op`` is not one a name is built by."""
    name = op.opname
    if name == "LOAD_CONST":
        stack.append((op.argval,) if isinstance(op.argval, str) else None)
    elif name in _VALUE_LOADS:
        stack.extend([None] * (1 + (name == "LOAD_GLOBAL" and op.arg & 1)))
        stack[-1] = (_ANY_TEXT,)
    elif name in _METHOD_LOADS:  # self.mode: its value, text or not; a method and its object
        if not stack:
            return False
        stack[-1:] = [None] * dis.stack_effect(op.opcode, op.arg, jump=False) + [(_ANY_TEXT,)]
    elif name in ("PRECALL", "KW_NAMES"):
        pass  # 3.11's: CALL pops what the call takes
    else:
        return _shape_of_operation(op, stack)
    return True


def _shape_of_operation(op: Any, stack: list[tuple[str, ...] | None]) -> bool:
    """:func:`_shape_after` of an operation on values already loaded."""
    name = op.opname
    if name == "CALL":  # str(n), self.mode.replace("-", "_"): its result, any text
        return _popped(stack, op.arg + 2, (_ANY_TEXT,))
    if name == "BINARY_OP" and op.argrepr in ("+", "+=") and len(stack) >= 2:
        right, left = stack.pop(), stack.pop()
        stack.append(None if left is None or right is None else _joined(left, right))
        return True
    if name in ("BINARY_OP", "BINARY_SUBSCR"):  # "%s_head" % k, cfg["mode"]: any text
        return _popped(stack, 2, (_ANY_TEXT,))
    if name == "FORMAT_VALUE":  # a spec (``:02d``) is no part of the name
        return _popped(stack, 2 if op.arg & 4 else 1, (_ANY_TEXT,))
    if name == "BUILD_STRING" and len(stack) >= op.arg:
        parts = stack[len(stack) - op.arg :]
        del stack[len(stack) - op.arg :]
        stack.append(_joined(*(p or (_ANY_TEXT,) for p in parts)))
        return True
    return False


def _popped(
    stack: list[tuple[str, ...] | None], count: int, pushed: tuple[str, ...] | None
) -> bool:
    """Pop ``count`` shapes off ``stack`` and push ``pushed``; False where it holds fewer."""
    if len(stack) < count:
        return False
    del stack[len(stack) - count :]
    stack.append(pushed)
    return True


def _joined(*shapes: tuple[str, ...]) -> tuple[str, ...]:
    """The shape of the texts of ``shapes`` joined: constants next to each other are one
    part, as are texts not known next to each other."""
    out: list[str] = []
    for part in (p for shape in shapes for p in shape):
        if out and (part == _ANY_TEXT) == (out[-1] == _ANY_TEXT):
            out[-1] = out[-1] if part == _ANY_TEXT else out[-1] + part
        else:
            out.append(part)
    return tuple(out)


#: The names a method's object or class goes by where it is no argument (a closure's cell).
_OWN_NAMES = frozenset({"self", "cls"})


def _own_object_end(code: Any, ins: list[Any], j: int) -> int | None:
    """Where the instructions after loading the method's object or class at ``ins[j]`` go
    on (``self``, ``cls``, ``self.__class__``, ``type(self)``, ``super()``), or None where
    ``ins[j]`` loads another object."""
    if j < len(ins) and ins[j].opname == "LOAD_GLOBAL" and ins[j].argval == "super":
        at = j + 1
        while at < len(ins) and ins[at].opname in _CALL_PREFIXES:
            at += 1
        bare = at < len(ins) and ins[at].opname == "CALL" and ins[at].arg == 0
        return at + 1 if bare else None
    if j < len(ins) and ins[j].opname == "LOAD_GLOBAL" and ins[j].argval == "type":
        k = _own_object_end(code, ins, j + 1)
        while k is not None and k < len(ins) and ins[k].opname in _CALL_PREFIXES:
            k += 1
        called = k is not None and k < len(ins) and ins[k].opname == "CALL" and ins[k].arg == 1
        return k + 1 if called and k is not None else None
    op = ins[j] if j < len(ins) else None
    if op is None or op.opname not in (*_ARGUMENT_LOADS, "LOAD_DEREF"):
        return None
    first = code.co_varnames[:1] if code.co_argcount else ()
    loaded = op.argval[-1] if op.opname in _JOINED_LOADS else op.argval
    if loaded not in first and loaded not in _OWN_NAMES:
        return None
    after = ins[j + 1] if j + 1 < len(ins) else None
    held = after is not None and after.opname in _METHOD_LOADS and after.argval == "__class__"
    return j + 2 if held else j + 1


def own_names(cls: type) -> frozenset[str]:
    """The names the user's classes in ``cls``'s MRO hold, but dunders (``__init__``,
    ``__module__``; a name made at run time is none of them) and what Python keeps there
    itself (:data:`_MACHINERY_NAMES`): what a forward that picks an attribute by a name
    made at run time (:func:`picks_at_run_time`) may read."""
    return frozenset(
        n
        for k, mine in _own_in_mro(cls)
        if mine
        for n in vars(k)
        if not (n.startswith("__") and n.endswith("__")) and n not in _MACHINERY_NAMES
    )


#: Names Python keeps on a class for itself: an ``abc.ABC``'s registry (no setting, keyed
#: by its address).
_MACHINERY_NAMES = frozenset({"_abc_impl"})


#: loaded_names's, by code object and class (:func:`kept_per_object`).
_LOADED: dict[Any, Any] = {}


def cached_names(cls: type) -> frozenset[str]:
    """The names of a class's ``functools.cached_property`` attributes (through its bases):
    an instance attribute of one of them is a value its code made from the rest, left out of
    a reading (its code is read), so its first use is no change. Kept per class."""
    kept = _CACHED.get(cls)
    if kept is None:
        names = {
            n
            for klass in cls.__mro__
            for n, v in vars(klass).items()
            if isinstance(v, functools.cached_property)
        }
        kept = _CACHED[cls] = frozenset(names)
    return kept


#: class -> its cached properties' names: cached_names's (weakly, as _SLOTS).
_CACHED: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _has_attributes(value: Any) -> bool:
    """Whether an object keeps its state in Python attributes (a ``__dict__`` or slots)."""
    return isinstance(getattr(value, "__dict__", None), dict) or bool(_slot_names(type(value)))


def _slot_names(cls: type) -> tuple[str, ...]:
    """The slots a class and its bases declare (``dataclass(slots=True)``, ``attrs``), kept
    per class (weakly: a class made at run time is freed as before)."""
    kept = _SLOTS.get(cls)
    if kept is not None:
        return kept
    names: list[str] = []
    for base in cls.__mro__:
        slots = base.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in names:
                names.append(slot)
    _SLOTS[cls] = tuple(names)
    return _SLOTS[cls]


#: class -> its slot names: _slot_names's.
_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def is_data(value: Any) -> bool:
    """Whether a global a hook's code reads is data keyed by its value (:func:`global_names`):
    no module, class or callable (functions, their wrappers, tensors' builtins).

    Example:
        >>> is_data({"gain": 2.0}), is_data(len), is_data(json)
        (True, False, False)
    """
    return not (isinstance(value, (types.ModuleType, type)) or callable(value))


#: What :meth:`HeldReading._globals` finds for a name its function's globals lack.
_ABSENT = object()


def followed_helper(value: Any) -> Any:
    """The user's own code a hook reaches through a global, read as a held function is (its
    code, what it holds and the globals it reads), or None: a function of the user's own code
    (``_apply_gain`` in ``return (_apply_gain(x),)``); a partial or bound method of one
    (``GAIN = partial(scaled, key="gain")``); a partial of any function that binds arguments
    (``partial(F.normalize, p=2)``: the arguments are settings, the library function is read
    by its name); an object of a class whose ``__call__`` is one
    (a torchaudio-style transform object); a function ``functools.lru_cache`` or ``cache``
    wraps (whisper's ``mel_filters``). A global that is none of these, or library code
    (:func:`is_own_code`: the standard library, installed packages, torch and featbake,
    whose changes the code rule and the library versions answer for), gives None. A decorated
    helper (``@torch.no_grad()``) is followed by the function it wraps where only that is the
    user's.

    Example:
        >>> followed_helper(len), followed_helper(json.dumps)
        (None, None)
    """
    if type(value) is types.FunctionType:
        if is_own_code(value):
            return value
        inner = unwrapped(value)
        return inner if inner is not value and is_own_code(inner) else None
    if isinstance(value, functools.partial):
        bound = bool(value.args or value.keywords)  # a library function's settings
        return value if bound or followed_helper(value.func) is not None else None
    if inspect.ismethod(value):
        return value if followed_helper(value.__func__) is not None else None
    if isinstance(value, (type, types.ModuleType)):
        return None
    wrapped = getattr(value, "__wrapped__", None)
    if type(value).__module__ == "functools" and inspect.isfunction(wrapped):
        return followed_helper(wrapped)  # @lru_cache, @cache: the function it caches
    runs = _runs(value)
    return value if inspect.isfunction(runs) and followed_helper(runs) is not None else None


def library_bound_anew(name: str, value: Any, where: Mapping[str, Any] | None) -> str | None:
    """A library's function a global binds otherwise than its source says (``models.ACT =
    torch.tanh`` set by a script where the file says ``ACT = torch.sigmoid``), by its module
    and qualified name, or None (read by the code rule, as before): which library function
    runs is a setting there, bound anew with no code of the module changed. One that is the
    very object the file's one top-level binding of it gives (``from torch.fft import rfft``,
    ``ACT = torch.sigmoid``, ``act = getattr(F, "gelu")``: :func:`statically_bound`) is the
    code's own choice, keyed by the file's source; ``where``: the globals of the code reading
    ``name`` (a dotted ``ops.act`` is looked up in module ``ops``'s file), a module of the
    user's (a library's own bindings are its version's). One under its own name (``from
    torch.nn.functional import *``, whisper's ``try``/``except`` import, a notebook cell's)
    is the code's choice too. A name bound in two places to functions of other names (``if``
    and ``else``) is a setting, keyed. Modules (``import numpy as np``), classes and scripted
    functions are code."""
    if not (inspect.isroutine(value) or isinstance(value, np.ufunc)):
        return None  # a module, a class, a scripted function (the user's code, compiled)
    own = getattr(value, "__name__", None)
    if where is None or not _own_globals(where) or own in (None, name.rpartition(".")[2]):
        return None
    if _as_the_file_binds(name, value, where):
        return None
    return library_function_text(value)


def library_function_text(value: Any) -> str:
    """A library's function as a key names it: its module and qualified name
    (``<torch._C._nn.gelu>``)."""
    qualname = getattr(value, "__qualname__", getattr(value, "__name__", "?"))
    return f"<{getattr(value, '__module__', None) or ''}.{qualname}>"


def class_library_bound_anew(cls: type, name: str, raw: Any) -> str | None:
    """A library's function a class of the user's holds under ``name`` (as
    :func:`inspect.getattr_static` finds it: ``raw``) otherwise than its class body binds it
    (``Block.act = torch.tanh`` set by a script where the body says ``act =
    torch.sigmoid``; ``staticmethod(F.gelu)`` read as its function), by its module and
    qualified name, as :func:`library_bound_anew` keys a
    global; None where the class holding it is a library's, or it is the very object the
    body's one binding gives (:func:`class_statically_bound`: the code's own choice, keyed by
    its source), or no library function."""
    value = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if not (inspect.isroutine(value) or isinstance(value, np.ufunc)) or is_own_code(value):
        return None
    holder = next((k for k in cls.__mro__ if name in vars(k)), None)
    if holder is None or is_library_code(holder):
        return None
    if class_statically_bound(holder, name) is value:
        return None
    return library_function_text(value)


def class_statically_bound(cls: type, name: str) -> Any:
    """The object the one binding of ``name`` in ``cls``'s class body (``act =
    torch.sigmoid``, ``from torch import tanh as act``) gives, resolved in its module's
    globals as :func:`statically_bound` resolves a top-level one, or ``_ABSENT`` where the
    body binds it otherwise, or the class's source is not found."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if module is None or not isinstance(filename, str):
        return _ABSENT
    bound = class_body_bindings(filename, cls.__qualname__).get(name, ())
    return _resolved(bound, vars(module))


def class_body_bindings(
    filename: str, qualname: str
) -> Mapping[str, tuple[tuple[str | None, tuple[str, ...]], ...]]:
    """What :func:`bound_in_source` gives for the body of the class ``qualname`` in
    ``filename`` (found by its names, nested classes through their bodies); empty where no
    one class of that name is found. Kept per file and name."""
    key = (filename, qualname)
    kept = _CLASS_BOUND.get(key)
    if kept is None:
        body = _module_tree(filename).body
        for part in qualname.split("."):
            found = [n for n in _top_level(body) if isinstance(n, ast.ClassDef) and n.name == part]
            body = found[0].body if len(found) == 1 else []
        kept = _CLASS_BOUND[key] = _bindings_in(body, unwrap=True)
    return kept


def _unwrapped(node: ast.stmt) -> ast.stmt:
    """``post = staticmethod(F.gelu)`` read as ``post = F.gelu`` (what the class runs)."""
    if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
        return node
    call = node.value
    named = isinstance(call.func, ast.Name) and call.func.id == "staticmethod"
    if named and len(call.args) == 1 and not call.keywords:
        return ast.Assign(targets=node.targets, value=call.args[0])
    return node


#: class_body_bindings's, by file and qualified name.
_CLASS_BOUND: dict[tuple[str, str], dict[str, tuple[tuple[str | None, tuple[str, ...]], ...]]] = {}


def _own_globals(where: Mapping[str, Any]) -> bool:
    """Whether ``where`` is the globals of a module of the user's (not a library's, whose
    own bindings the library's version answers for)."""
    top = str(where.get("__name__") or "").partition(".")[0]
    filename = where.get("__file__")
    return _own_source(top, filename if isinstance(filename, str) else "")


def _as_the_file_binds(name: str, value: Any, where: Mapping[str, Any]) -> bool:
    """Whether global ``name`` (dotted: through the user's modules) of the globals ``where``
    holds the object its module's file binds it to (:func:`statically_bound`)."""
    *path, last = name.split(".")
    scope: Any = where
    for part in path:  # ops.act: the module ops's own globals
        held = scope.get(part) if isinstance(scope, Mapping) else None
        if not isinstance(held, types.ModuleType):
            return False
        scope = vars(held)
    filename = scope.get("__file__")
    if not isinstance(filename, str):
        return False
    return statically_bound(filename, last, scope) is value


def statically_bound(filename: str, name: str, scope: Mapping[str, Any]) -> Any:
    """The object the one top-level binding of ``name`` in ``filename`` gives, resolved in
    the module's globals ``scope`` (``from torch.fft import rfft``: torch.fft's ``rfft``;
    ``ACT = torch.sigmoid``: ``scope["torch"].sigmoid``; ``ACT = getattr(torch, "tanh")``),
    or ``_ABSENT`` where the file binds it otherwise (in two places, by a call, a tuple) or
    is not read. Only modules' attributes are read: no code runs."""
    return _resolved(bound_in_source(filename).get(name, ()), scope)


def _resolved(
    bound: tuple[tuple[str | None, tuple[str, ...]], ...], scope: Mapping[str, Any]
) -> Any:
    """The object one binding read from a file (:func:`bound_in_source`) gives, resolved in
    the module's globals ``scope``; ``_ABSENT`` where there are two or it reads no dotted
    name."""
    if len(bound) != 1 or not bound[0][1]:  # bound twice, or by no dotted name
        return _ABSENT
    module, chain = bound[0]
    if module is not None:
        package = scope.get("__package__") or ""
        try:
            found: Any = sys.modules.get(importlib.util.resolve_name(module, package))
        except (ImportError, ValueError):
            return _ABSENT
    else:
        found = scope.get(chain[0], _ABSENT)
        chain = chain[1:]
    for part in chain:
        if not isinstance(found, types.ModuleType) and not inspect.isclass(found):
            return _ABSENT
        found = namespace_attribute(found, part)
    return found


def bound_in_source(filename: str) -> Mapping[str, tuple[tuple[str | None, tuple[str, ...]], ...]]:
    """Each name the file's top level (``if`` and ``try`` blocks too) binds by an import
    from a module or an assignment of a dotted name (or ``getattr`` of one by a constant),
    with what each binding reads: ``(module, (name,))`` for ``from module import name``
    (``module`` with its leading dots, relative), ``(None, ("torch", "sigmoid"))`` for ``ACT =
    torch.sigmoid``; a binding by anything else (a call, a tuple, a conditional) as ``(None,
    ())``, which resolves to nothing. Empty for a file not read (none, or no Python). Kept
    per file.

    Example:
        >>> bound_in_source("<stdin>")
        {}
    """
    kept = _BOUND.get(filename)
    if kept is None:
        kept = _BOUND[filename] = _bindings_in(_module_tree(filename).body)
    return kept


def _bindings_in(
    body: list[ast.stmt], unwrap: bool = False
) -> dict[str, tuple[tuple[str | None, tuple[str, ...]], ...]]:
    """Each name ``body`` (its ``if``, ``try`` and ``with`` blocks too) binds, with what each
    binding reads (:func:`_bindings`); ``unwrap``: a ``staticmethod(...)`` read as what it
    wraps (:func:`_unwrapped`: a class body's)."""
    bound: dict[str, list[tuple[str | None, tuple[str, ...]]]] = {}
    for node in _top_level(body):
        for target, source in _bindings(_unwrapped(node) if unwrap else node):
            bound.setdefault(target, []).append(source)
    return {k: tuple(v) for k, v in bound.items()}


def _module_tree(filename: str) -> ast.Module:
    """The parsed source of ``filename`` (an empty module where it is not read: none, or no
    Python), parsed once a process: what each reading of a file's bindings starts from."""
    tree = _TREES.get(filename)
    if tree is None:
        try:
            tree = ast.parse(Path(filename).read_bytes())
        except (OSError, SyntaxError, ValueError):
            tree = ast.Module(body=[], type_ignores=[])
        _TREES[filename] = tree
    return tree


#: _module_tree's, by file name.
_TREES: dict[str, ast.Module] = {}


#: bound_in_source's, by file name.
_BOUND: dict[str, dict[str, tuple[tuple[str | None, tuple[str, ...]], ...]]] = {}


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module's top level, those in its ``if``, ``try`` and ``with``
    blocks too (``try: from x import y except ImportError: ...``)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            yield from _top_level(nested)


def _bindings(node: ast.stmt) -> list[tuple[str, tuple[str | None, tuple[str, ...]]]]:
    """``(name bound, what it reads)`` for each name a statement binds (:func:`bound_in_source`)."""
    if isinstance(node, ast.ImportFrom):
        module = "." * node.level + (node.module or "")
        return [(a.asname or a.name, (module, (a.name,))) for a in node.names]
    if isinstance(node, ast.Import):
        return [(a.asname or a.name.partition(".")[0], (None, ())) for a in node.names]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [(node.name, (None, ()))]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        single = len(targets) == 1 and isinstance(targets[0], ast.Name)
        read = _dotted(node.value) if single and not isinstance(node, ast.AugAssign) else ()
        return [(n, (None, read)) for n in names]
    return []


def _dotted(value: ast.expr) -> tuple[str, ...]:
    """``a.b.c`` (or ``getattr(a.b, "c")``) as ``("a", "b", "c")``; ``()`` for anything else."""
    if isinstance(value, ast.Name):
        return (value.id,)
    if isinstance(value, ast.Attribute):
        head = _dotted(value.value)
        return (*head, value.attr) if head else ()
    getter = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "getattr"
    if getter and len(value.args) == 2 and not value.keywords:  # type: ignore[attr-defined]
        obj, attr = value.args  # type: ignore[attr-defined]
        head = _dotted(obj)
        named = isinstance(attr, ast.Constant) and isinstance(attr.value, str)
        return (*head, attr.value) if head and named else ()
    return ()


def is_own_code(func: Any) -> bool:
    """Whether a plain function is the user's own code: not library machinery
    (:func:`is_library_machinery`), of no module of :data:`UNVERSIONED` or the standard
    library, and from no file under the standard library's or installed packages' folders
    (:class:`CodeClosure`'s rule for what is the user's). Kept per code object."""
    if type(func) is not types.FunctionType or is_library_machinery(func):
        return False
    code = func.__code__
    top = (getattr(func, "__module__", None) or "").partition(".")[0]
    return kept_per_object(_OWN_CODE, (code,), top, lambda: _own_source(top, code.co_filename))


def _own_source(top: str, filename: str) -> bool:
    """Whether code of the module named ``top`` (its top package) from ``filename`` is the
    user's: of no module of :data:`UNVERSIONED` or the standard library, and from no file
    under the standard library's or installed packages' folders."""
    named = top in UNVERSIONED or top in sys.stdlib_module_names
    return not named and not filename.startswith("<frozen") and not _installed_file(filename)


def _installed_file(filename: str) -> bool:
    """Whether ``filename`` lies under the standard library's or installed packages' folders."""
    if filename.startswith("<"):
        return False  # exec'd or typed in: the user's
    try:
        return _under(Path(filename).resolve(), _INSTALLED_ROOTS())
    except (OSError, ValueError):
        return False


#: is_own_code's, by code object and top module name (:func:`kept_per_object`).
_OWN_CODE: dict[Any, Any] = {}


def global_module_digest(module: torch.nn.Module, *, exact: bool = False) -> str:
    """SHA-256 of a module a hook reads as a global (an adapter run on the output): its class,
    repr, code (:func:`code_identity`), plain attributes, each submodule's mode, and every
    parameter, buffer and tensor attribute by value (:func:`~featbake.keys.module_fingerprint`,
    as the hooked module's own weights are keyed). A watch reads it at each forward, so it is
    made anew only where the module's tensors (by id, version and pointer), submodules, modes
    or attributes changed, or where ``exact`` (a key, a check before misses: an edit behind
    the version counters, ``weight.data.mul_``, is seen there, and the digest kept for the
    watch's reads is the new one, and an in-place edit of an inference tensor, which keeps no
    version, is seen there too). A module met again while its own digest is made (a
    submodule holding its owner in a namespace or list) reads as ``<cycle>``."""
    making = _MAKING.__dict__.setdefault("ids", set())
    if id(module) in making:
        return "<cycle>"
    making.add(id(module))
    try:
        stamp = _module_stamp(module)
        kept = _GLOBAL_MODULES.get(module)
        if not exact and kept is not None and kept[0] == stamp:
            return kept[1]
        owner = f"{_script_named(type(module).__module__)}.{type(module).__qualname__}"
        modes = [sub.training for sub in module.modules()]
        ident = f"global-module:{owner}\n{module!r}\ncode:{code_identity(module)}"
        ident = f"{ident}\nattrs:{attribute_identity(module)}\nmodes:{modes}"
        digest = module_fingerprint(module, ident)
        _GLOBAL_MODULES[module] = (stamp, digest)
        return digest
    finally:
        making.discard(id(module))


#: The ids of the modules whose :func:`global_module_digest` is being made, per thread.
_MAKING = threading.local()


def _script_named(owner: str) -> str:
    """A class's module name as a key reads it: the script run's (``__mp_main__`` in a spawned
    worker) as ``__main__``, so a worker's copy reads as its parent's (as :func:`hook_code`)."""
    return "__main__" if owner == "__mp_main__" else owner


#: What a refusal of a global module left in train mode says (:func:`mode_dependent_submodule`),
#: so the refusal's advice is to call ``.eval()`` on it.
IN_TRAIN_MODE = "in train mode, where its forward draws or behaves by it"


def mode_dependent_submodule(module: torch.nn.Module) -> str | None:
    """The first submodule of ``module`` (named, with its class) in train mode whose forward
    behaves by its mode (:func:`~featbake.keys.reads_training`: a ``Dropout``, a
    ``BatchNorm``), or None. A global module a hook runs left in train mode draws anew at each
    forward (one draw would be stored and served), as an encoder in train mode does; one in
    train mode whose forward never reads it (an ``nn.Linear`` made at module level) behaves
    the same in either mode and passes.

    Example:
        >>> seq = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
        >>> mode_dependent_submodule(seq), mode_dependent_submodule(seq.eval())
        ('submodule 1, a Dropout', None)
    """
    for sub_name, sub in module.named_modules():
        if sub.training and reads_training(type(sub)):
            what = f"a {type(sub).__qualname__}"
            return f"submodule {sub_name}, {what}" if sub_name else what
    return None


def _module_stamp(module: torch.nn.Module) -> tuple[Any, ...]:
    """What :func:`global_module_digest` reads of a module at each forward: its tensors' ids,
    versions, pointers, dtypes and shapes, a CRC-32C of each one's bytes on the CPU (an edit
    behind the version counters, ``weight.data.mul_`` as an EMA update makes, is seen at each
    forward, as a ``CachedEncoder`` probes its own module's weights: ~4 ms for 100 MB), its
    submodules' classes and modes, and its plain attributes' digest (an inference tensor's
    version as -1: :func:`_version`). A tensor on a device is read by its version alone here
    (the exact read before each batch of misses reads its values)."""
    tensors = [*module.parameters(), *module.buffers()]
    tensors += [t for _, t in tensor_attributes(module)]
    read = tuple(
        (id(t), _version(t), t.data_ptr(), t.dtype, t.shape, _host_crc(t)) for t in tensors
    )
    subs = tuple((type(sub), sub.training) for sub in module.modules())
    return (read, subs, attribute_identity(module))


def _host_crc(tensor: torch.Tensor) -> int | None:
    """The CRC-32C of a tensor's bytes where it is on the CPU and has any (None elsewhere)."""
    t = tensor.detach()
    if t.device.type != "cpu" or not t.numel():
        return None
    return crc32c_tensor(t)


def _version(tensor: torch.Tensor) -> int:
    """A tensor's version counter; an inference tensor (made or loaded under
    ``torch.inference_mode()``) keeps none and reads as -1: an in-place edit of it (allowed
    only in inference mode) is seen by the exact read before each batch of misses, as an
    edit behind a version counter (``weight.data.mul_``) is."""
    return -1 if tensor.is_inference() else tensor._version


#: module -> (its stamp, its digest): global_module_digest's (weakly: a module freed is
#: forgotten).
_GLOBAL_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, str]] = (
    weakref.WeakKeyDictionary()
)


def global_names(code: Any) -> tuple[str, ...]:
    """The global names a code object and the code nested in it load (``LOAD_GLOBAL``),
    sorted; kept per code object (the object held so its id is not lent)."""
    return kept_per_object(_GLOBAL_NAMES, (code,), None, lambda: _loaded_globals(code))


def _loaded_globals(code: Any) -> tuple[str, ...]:
    """:func:`global_names`, made anew: each ``LOAD_GLOBAL``, and each name read through
    ``globals()`` by a constant (:func:`globals_asked`)."""
    loads = (op for each in reached_code(code, None) for op in dis.get_instructions(each))
    names = {op.argval for op in loads if op.opname == "LOAD_GLOBAL"}
    return tuple(sorted(names.union(globals_asked(code).read)))


def globals_named(
    func: Any, set_shapes: frozenset[tuple[str, ...]] = frozenset()
) -> tuple[str, ...]:
    """The globals ``func``'s code reads (:func:`global_names`), and, where it reads
    ``globals()`` otherwise than by a constant name (``globals()[self.act_name]``, passed
    on: :attr:`GlobalsAsked.whole`), every global of its file but the module's dunders and
    those the code, or the functions of its forward (``set_shapes``), sets by a name made at
    run time (``globals()["_warned_" + k] = True``: the names of that shape, its own state:
    keyed, each run would change the key), unless the file binds them itself
    (:func:`file_bound_names`: ``SCALE_fast = 2.0``, a setting however else it is set).
    Where such a name has no part known, only the globals the file binds are read."""
    names = global_names(func.__code__)
    asked = globals_asked(func.__code__)
    if not asked.whole:
        return names
    found = getattr(func, "__globals__", {})
    shapes = asked.set_shapes | set_shapes
    every = [g for g in found if not (g.startswith("__") and g.endswith("__"))]
    if not shapes:
        return tuple(sorted({*names, *every}))
    bound = file_bound_names(func.__code__.co_filename, found)
    if not all(known_part(s) for s in shapes):  # globals()[k] = v: any name may be its own
        every = [g for g in every if g in bound] if bound else every
    own = _fitting(every, shapes, any_name=False) - bound  # what the file binds: a setting
    return tuple(sorted({*names, *(g for g in every if g not in own)}))


def file_bound_names(filename: str, scope: Mapping[str, Any]) -> frozenset[str]:
    """The globals the file ``filename`` binds by its own statements: at its top level (an
    assignment, a ``for`` target, a walrus, an import, a ``def`` or ``class``), by a ``global``
    statement anywhere, and the public names of each module it imports ``*`` from (resolved
    in its globals ``scope``); empty for a file not read. The file is read once a process
    (as :func:`bound_in_source`); a watch asks at each forward."""
    kept = _FILE_BOUND.get(filename)
    if kept is None:
        kept = _FILE_BOUND[filename] = _bound_by_statements(_module_tree(filename))
    names, starred = kept
    return names.union(*(_public_names(module, scope) for module in starred))


#: file_bound_names's file-read part, by file name: the names, and the modules it imports
#: ``*`` from (with their leading dots, relative).
_FILE_BOUND: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {}


def _bound_by_statements(tree: ast.Module) -> tuple[frozenset[str], tuple[str, ...]]:
    """:func:`file_bound_names`' names ``tree`` binds, and the modules it imports ``*``
    from."""
    names: set[str] = set()
    starred: list[str] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue  # its body binds its own names
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            starred.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
        todo.extend(ast.iter_child_nodes(node))
    names |= {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    return frozenset(names), tuple(starred)


def _public_names(module: str, scope: Mapping[str, Any]) -> set[str]:
    """The public names of ``module`` (its ``__all__``, else those not begun by ``_``), found
    in ``sys.modules`` (resolved against the package of the globals ``scope``)."""
    try:
        found = sys.modules.get(importlib.util.resolve_name(module, scope.get("__package__") or ""))
    except (ImportError, ValueError):
        return set()
    public = getattr(found, "__all__", None)
    if public is None:
        public = [n for n in vars(found) if not n.startswith("_")] if found is not None else []
    return {str(n) for n in public}


@dataclass(frozen=True)
class GlobalsAsked:
    """What a code object (and the code nested in it) asks of ``globals()``: the names it
    reads by a constant (``globals()["K"]``, ``globals().get("K", d)``, ``"K" in
    globals()``), those it sets or deletes by a constant (``globals()["K"] = v``,
    ``globals().setdefault("K", v)``: its own state, as a ``global K`` it writes is), and
    whether it reads ``globals()`` any other way (a name made at run time, the dict passed
    on or iterated), where every global may be read. Setting a global by a name made at
    run time (``globals()["_warned_" + k] = True``) reads none."""

    read: frozenset[str] = frozenset()
    written: frozenset[str] = frozenset()
    whole: bool = False
    #: The shapes (:class:`RunTimePicks`) of the names it sets by a name made at run time.
    set_shapes: frozenset[tuple[str, ...]] = frozenset()


def globals_asked(code: Any) -> GlobalsAsked:
    """:class:`GlobalsAsked` of ``code``; kept per code object."""
    return kept_per_object(_GLOBALS_ASKED, (code,), None, lambda: _globals_asked(code))


#: globals_asked's, by code object (:func:`kept_per_object`).
_GLOBALS_ASKED: dict[Any, Any] = {}


def _globals_asked(code: Any) -> GlobalsAsked:
    """:func:`globals_asked`, made anew."""
    read: set[str] = set()
    written: set[str] = set()
    shapes: set[tuple[str, ...]] = set()
    whole = False
    for each in reached_code(code, None):
        if "globals" not in each.co_names:
            continue
        ins = list(dis.get_instructions(each))
        for i, op in enumerate(ins):
            if op.opname not in ("LOAD_GLOBAL", "LOAD_NAME") or op.argval != "globals":
                continue
            use = _globals_use(ins, i)
            if use is None:
                whole = True
            elif use.name is None:  # set by a name made at run time: its own state, no read
                shapes.add(use.shape)
            elif use.sets:
                written.add(use.name)
            else:
                read.add(use.name)
    return GlobalsAsked(frozenset(read), frozenset(written), whole, frozenset(shapes))


@dataclass(frozen=True)
class GlobalsUse:
    """One use of ``globals()``: the constant name it reads or sets (None: a name made at
    run time, set, of the shape ``shape``: :class:`RunTimePicks`), and whether it sets it."""

    name: str | None
    sets: bool
    shape: tuple[str, ...] = ()


#: What ``globals()``'s dict is asked through that sets a name (``.setdefault(k, v)``).
_GLOBALS_SETTERS = frozenset({"setdefault", "pop", "update", "__setitem__", "__delitem__"})


def _globals_use(ins: list[Any], i: int) -> GlobalsUse | None:
    """The use of ``globals()`` called at ``ins[i]`` (the load of ``globals``): a constant
    name read or set (``globals()["K"] = v``, ``del globals()["K"]``, ``.setdefault``), or
    a name made at run time set (``globals()[f"STAT_{n}"] = v``, ``.setdefault(k, v)``);
    None for any other use (read by a name made at run time, passed on, iterated)."""
    k = i + 1
    while k < len(ins) and ins[k].opname in _CALL_PREFIXES:
        k += 1
    if k >= len(ins) or ins[k].opname != "CALL" or ins[k].arg:
        return None
    after = ins[k + 1 : k + 3]
    ops = [o.opname for o in after]
    subscripted = ops[1:] and ops[1] in ("BINARY_SUBSCR", "STORE_SUBSCR", "DELETE_SUBSCR")
    if subscripted and ops[0] == "LOAD_CONST" and isinstance(after[0].argval, str):
        return GlobalsUse(after[0].argval, ops[1] != "BINARY_SUBSCR")
    if ops[:1] and ops[0] in _METHOD_LOADS and after[0].argval in ("get", *_GLOBALS_SETTERS):
        sets = after[0].argval in _GLOBALS_SETTERS
        name = _constant_argument(ins, k + 2)
        return GlobalsUse(name, sets) if name is not None or sets else None  # shape: any
    before = ins[i - 1] if i > 0 else None
    named = before.argval if before is not None and before.opname == "LOAD_CONST" else None
    if ops[:1] == ["CONTAINS_OP"] and isinstance(named, str):
        return GlobalsUse(named, False)
    shape = _set_by_a_name_made_now(ins, k + 1)
    return None if shape is None else GlobalsUse(None, True, shape)


def _set_by_a_name_made_now(ins: list[Any], j: int) -> tuple[str, ...] | None:
    """The shape (:class:`RunTimePicks`) of the name ``globals()``'s dict, on the stack
    before ``ins[j]``, is next subscripted to set or delete an item by (``globals()["_warned_"
    + k] = True``: ``("_warned_", any text)``; ``()`` where the name is not followed), or
    None where the next subscript reads (found by the stack's depth: the dict and the name
    on it)."""
    depth, stack = 1, list[tuple[str, ...] | None]([None])
    followed = True
    for op in ins[j:]:
        if op.opname in ("STORE_SUBSCR", "DELETE_SUBSCR", "BINARY_SUBSCR") and depth == 2:
            if op.opname == "BINARY_SUBSCR":
                return None
            shape = stack[-1] if followed and len(stack) == 2 and stack[-1] else ()
            return shape if known_part(shape) else ()
        followed = followed and _shape_after(op, stack)
        try:
            depth += dis.stack_effect(op.opcode, op.arg, jump=False)
        except ValueError:  # an opcode with no effect of its own (a cache entry)
            continue
        if depth < 2 and op.opname not in _CALL_PREFIXES:
            return None
    return None


class Read(enum.Enum):
    """How a global is read where each use of it names what it reads (:func:`names_read`)."""

    #: A mapping by a constant key: ``m["X"]``, ``m.get("X")``, ``m.get("X", d)``, ``"X" in m``.
    BY_KEY = "key"
    #: A getter called with a constant first argument: ``getenv("X")``, ``getenv("X", d)``.
    BY_ARGUMENT = "argument"
    #: An object by an attribute's name: ``args.gain``.
    BY_FIELD = "field"


def names_read(code: Any, dotted: str, how: Read) -> tuple[str, ...] | None:
    """The names the global at ``dotted`` (a global, or one reached through attributes:
    ``os.environ``) is read by in a code object and the code nested in it, sorted, where each
    use of it reads one name ``how`` says, by a constant, and nothing is made of it first;
    None where a use does not (``environ.get("X" + s)``, ``dict(environ)``, passed on,
    iterated): then the whole value is keyed. A read by a constant name gives that item's
    value and nothing else, so the others (a job id, a learning rate) change no output and
    no key. Kept per code object, name and way.

    Example:
        >>> from os import environ
        >>> def gain():
        ...     return float(environ.get("GAIN", "2")) + ("BIAS" in environ)
        >>> names_read(gain.__code__, "environ", Read.BY_KEY)
        ('BIAS', 'GAIN')
    """
    return kept_per_object(
        _NAMES_READ, (code,), (dotted, how), lambda: _names_read(code, dotted.split("."), how)
    )


def _names_read(code: Any, parts: list[str], how: Read) -> tuple[str, ...] | None:
    """:func:`names_read`, made anew: None where no use is seen (reached by ``getattr``, or
    through a local: :func:`reached_otherwise`)."""
    names: set[str] = set()
    written: set[str] = set()
    if (
        reached_otherwise(code, parts)
        or parts[0] in globals_asked(code).read
        or _import_used_otherwise(code, parts[0])
    ):
        return None  # globals()["CFG"]["gain"] beside CFG["bias"]: no use says all it reads
    for ins, start, end in _chain_sites(code, parts):
        field = field_written(ins, end) if how is Read.BY_FIELD else None
        if field is not None:
            written.add(field)  # ``MONITOR.last = v``, ``STATS.calls += 1``: the code's own
            continue
        read = _name_read(ins, start, end, how)
        if read is None:
            return None
        names.add(read)
    if written:  # a field it writes is its own, read back or not (``written_below``'s rule)
        return tuple(sorted(names - written))
    return tuple(sorted(names)) if names else None


def reached_otherwise(code: Any, parts: list[str]) -> bool:
    """Whether the global reached at ``parts`` (a global, then its attributes by name) is
    also reached other than by its name and attributes at once (:func:`root_chains`:
    ``cfg = config; cfg.SETTINGS``): then no use of it seen by name says all it reads."""
    rest = tuple(parts[1:])
    return any(
        root == ("global", parts[0]) and chain[: len(rest)] == rest[: len(chain)]
        for root, chain in root_chains(code)
    )


def _chain_sites(code: Any, parts: list[str]) -> Iterator[tuple[list[Any], int, int]]:
    """``(instructions, start, end)`` of each use of the global reached at ``parts`` (a
    global, then its attributes by name) in a code object and the code nested in it: the
    load of the global at ``start``, the load that ends the chain at ``end``. A load of the
    global followed by another name (``os.path`` for ``os.environ``) is no use of it."""
    for each in reached_code(code, None):
        ins = list(dis.get_instructions(each))
        local = import_locals(each, ins, parts[0])
        for i, op in enumerate(ins):
            as_global = op.opname == "LOAD_GLOBAL" and op.argval == parts[0]
            if as_global or (op.opname in _ARGUMENT_LOADS and op.argval in local):
                end = _chain_end(ins, i, parts)
                if end is not None:
                    yield ins, i, end


def import_locals(code: Any, ins: list[Any], module: str) -> frozenset[str]:
    """The locals of ``code`` (its instructions ``ins``) an ``import module`` (``import os``,
    ``import os as o``) in it binds: read as the global of that name is (a function-local
    ``import os`` reading ``os.environ.get("GAIN")`` reads that variable alone)."""
    if "IMPORT_NAME" not in {op.opname for op in ins}:
        return frozenset()
    aliases: dict[Any, set[Any]] = {}
    for i, op in enumerate(ins):
        if op.opname == "IMPORT_NAME" and i >= 2:
            _imported_names(code, ins, i, aliases)
    whole = (("import", module, "0"), ())
    return frozenset(
        key[1] for key, held in aliases.items() if isinstance(key, tuple) and whole in held
    )


def _import_used_otherwise(code: Any, module: str) -> bool:
    """Whether a local an ``import module`` binds (:func:`import_locals`) is used other than
    by reading an attribute of it at once (``f(os)``, returned), or the module is reached by
    a call (``__import__("os").environ``, ``importlib.import_module``) or out of
    ``sys.modules``: then no use of it seen by name says all it reads."""
    for each in reached_code(code, None):
        names = set(each.co_names)
        if {"__import__", "import_module"} & names or {"sys", "modules"} <= names:
            return True  # read whole, as before: rare, and no use of it is followed
        ins = list(dis.get_instructions(each))
        local = import_locals(each, ins, module)
        for i, op in enumerate(ins[:-1]):
            loaded = op.opname in _ARGUMENT_LOADS and op.argval in local
            if loaded and ins[i + 1].opname not in _METHOD_LOADS:
                return True
    return False


def _chain_end(ins: list[Any], i: int, parts: list[str]) -> int | None:
    """The index of the load that ends ``parts`` (a global, then its attributes by name)
    begun at ``ins[i]``, or None where another name follows the global there."""
    for k, part in enumerate(parts[1:], start=1):
        op = ins[i + k] if i + k < len(ins) else None
        if op is None or op.opname not in _METHOD_LOADS or op.argval != part:
            return None
    return i + len(parts) - 1


def _global_updated(ins: list[Any], i: int) -> bool:
    """Whether the global loaded at ``ins[i]`` has a field set on it (:func:`sets_a_field`)
    or an in-place method called on it right after (``ACC.add_(x)``, ``WIN.copy_(w)``: a
    tensor's trailing underscore)."""
    after = ins[i + 1] if i + 1 < len(ins) else None
    name = str(after.argval) if after is not None and after.opname in _METHOD_LOADS else ""
    in_place = name.endswith("_") and not name.startswith("_")
    return in_place or sets_a_field(ins, i)


def sets_a_field(ins: list[Any], i: int) -> bool:
    """Whether the value loaded at ``ins[i]`` has a field set, bumped or deleted on it right
    after (:func:`field_written`)."""
    return field_written(ins, i) is not None


def field_written(ins: list[Any], i: int) -> str | None:
    """The field the value loaded at ``ins[i]`` has set or deleted on it right after
    (``shared.MONITOR.last = v``), or bumped in place (``STATS.calls += 1``: the value
    copied, the field loaded, then stored), or None: a global object a forward notes a value
    on, which it reads nothing of there but that field's own old value. Only a global's: an
    object a module holds under an attribute is read by
    :func:`~featbake.keys.written_below`, which keeps what a subclass reads of it."""
    after = ins[i + 1 : i + 3]
    if after and after[0].opname in ("STORE_ATTR", "DELETE_ATTR"):
        return str(after[0].argval)
    bumped = [o.opname for o in after] == ["COPY", "LOAD_ATTR"] and after[0].argval == 1
    return str(after[1].argval) if bumped else None


def _name_read(ins: list[Any], start: int, end: int, how: Read) -> str | None:
    """The name the value loaded by ``ins[start:end + 1]`` is read by ``how``, where a
    constant names it right after the load; None for any other use."""
    after = ins[end + 1 : end + 3]
    ops = [o.opname for o in after]
    if how is Read.BY_FIELD:
        return str(after[0].argval) if ops[:1] and ops[0] in _METHOD_LOADS else None
    if how is Read.BY_ARGUMENT:
        return _constant_argument(ins, end + 1)
    if ops[:1] and ops[0] in _METHOD_LOADS:
        return _constant_argument(ins, end + 2) if after[0].argval == "get" else None
    if ops == ["LOAD_CONST", "BINARY_SUBSCR"] and isinstance(after[0].argval, str):
        return after[0].argval
    before = ins[start - 1] if start > 0 else None
    if ops[:1] == ["CONTAINS_OP"] and before is not None and before.opname == "LOAD_CONST":
        return before.argval if isinstance(before.argval, str) else None
    return None


def _constant_argument(ins: list[Any], k: int) -> str | None:
    """The constant string ``ins[k]`` loads as the first argument of a call made right
    after it, with at most one more argument (a constant, a local or a global), or None. A
    ``PUSH_NULL`` before it is skipped: Python 3.13 loads a callable read as an attribute of a
    module (``os.getenv``) or object (``environ.get``) and then its NULL."""
    if k < len(ins) and ins[k].opname == "PUSH_NULL":
        k += 1
    ops = [o.opname for o in ins[k : k + 3]]
    if ops[:1] != ["LOAD_CONST"] or not isinstance(ins[k].argval, str):
        return None
    called = ops[1:2] in (["PRECALL"], ["CALL"]) or (
        ops[1:2] in (["LOAD_CONST"], ["LOAD_FAST"], ["LOAD_GLOBAL"])
        and ops[2:3] in (["PRECALL"], ["CALL"])
    )
    return ins[k].argval if called else None


#: names_read's, by code object, dotted name and way (:func:`kept_per_object`).
_NAMES_READ: dict[Any, Any] = {}


def only_recorded(code: Any, dotted: str) -> bool:
    """Whether every use of the global reached at ``dotted`` (``shared.ACTIVATION``) in a
    code object and the code nested in it records into it
    (:func:`~featbake.keys.records_into`: ``shared.ACTIVATION["out"] = o``): bookkeeping,
    as a bare global only recorded into is (:func:`bookkeeping_names`). Kept per code
    object and name."""
    return bool(kept_per_object(_RECORDED, (code,), dotted, lambda: _only_recorded(code, dotted)))


def _only_recorded(code: Any, dotted: str) -> bool:
    """:func:`only_recorded`, made anew."""
    sites = 0
    parts = dotted.split(".")
    if reached_otherwise(code, parts) or parts[0] in globals_asked(code).read:
        return False
    for ins, _, end in _chain_sites(code, dotted.split(".")):
        if not _recorded_site(ins, end):
            return False
        sites += 1
    return sites > 0  # none: reached otherwise (getattr), read


#: only_recorded's, by code object and dotted name (:func:`kept_per_object`).
_RECORDED: dict[Any, Any] = {}


def _recorded_site(ins: list[Any], end: int) -> bool:
    """Whether the use of a global whose chain ends at ``ins[end]`` records into it
    (:func:`~featbake.keys.records_into`) or sets a field on it (:func:`sets_a_field`)."""
    return records_into(ins, end) or sets_a_field(ins, end)


def recorded_at_all(code: Any, dotted: str) -> bool:
    """Whether some use of the global reached at ``dotted`` in a code object (and the code
    nested in it) records into it or sets a field on it (a memo dict filled, a monitor's
    field set); kept per code object and name."""
    return bool(
        kept_per_object(
            _RECORDED_ANYWHERE,
            (code,),
            dotted,
            lambda: any(
                _recorded_site(ins, end) for ins, _, end in _chain_sites(code, dotted.split("."))
            ),
        )
    )


#: recorded_at_all's, by code object and dotted name (:func:`kept_per_object`).
_RECORDED_ANYWHERE: dict[Any, Any] = {}


def attribute_chains(code: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``(global, (name, ...))`` for each global a code object (and the code nested in it)
    loads and then reads attributes of by name (``utils.apply_gain(x)``: ``("utils",
    ("apply_gain",))``; ``getattr(config, "GAIN", 1.0)`` too), the names in the order read,
    sorted; kept per code object.

    Example:
        >>> import os
        >>> def gain():
        ...     return float(os.environ.get("GAIN", "2"))
        >>> attribute_chains(gain.__code__)
        (('os', ('environ', 'get')),)
    """
    return kept_per_object(_CHAINS, (code,), None, lambda: _attribute_chains(code))


def _attribute_chains(code: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """:func:`attribute_chains`, made anew."""
    chains: set[tuple[str, tuple[str, ...]]] = set()
    for each in reached_code(code, None):
        ins = list(dis.get_instructions(each))
        for i, op in enumerate(ins):
            if op.opname != "LOAD_GLOBAL":
                continue
            names = list(itertools.takewhile(lambda o: o.opname in _METHOD_LOADS, ins[i + 1 :]))
            if names:
                chains.add((op.argval, tuple(str(o.argval) for o in names)))
            if op.argval == "getattr" and (by_name := _getattr_chain(ins, i)) is not None:
                chains.add(by_name)
    return tuple(sorted(chains))


def _getattr_chain(ins: list[Any], i: int) -> tuple[str, tuple[str, ...]] | None:
    """``getattr(config, "GAIN"[, default])`` at ``ins[i]`` (the load of ``getattr``) as the
    chain ``("config", ("GAIN",))``, where a global and a constant name are its arguments."""
    after = ins[i + 1 : i + 3]
    if [o.opname for o in after] != ["LOAD_GLOBAL", "LOAD_CONST"]:
        return None
    return (str(after[0].argval), (after[1].argval,)) if isinstance(after[1].argval, str) else None


#: attribute_chains's, by code object (:func:`kept_per_object`).
_CHAINS: dict[Any, Any] = {}


def root_chains(code: Any) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """``(root, (name, ...))`` for each value a code object (and the code nested in it) reads
    attributes of by name where no global is followed by them at once (those are
    :func:`attribute_chains`'): a module or object kept in a local first (``cfg = config``,
    ``(cfg := config)``, ``a = config.audio``), imported in the function (``import config as
    cfg``; ``from config import GAIN`` reads ``("GAIN",)`` of it), held in a closure cell, an
    argument (a default) or an attribute of the first argument (``self.cfg_module``). A root
    is ``("global", name)``, ``("import", module, level)``, ``("cell", name)``, ``("param",
    name)`` or ``("self", attribute)``; ``("bare", name)`` a global used at once other than
    by attribute. A chain ending in ``"*"`` is a use of the value it reaches other than by
    attribute (passed on, returned, stored elsewhere): a module of the user's used so is read
    whole. Kept per code object.

    Example:
        >>> def gain(x):
        ...     import json as j
        ...     return j.dumps
        >>> root_chains(gain.__code__)
        ((('import', 'json', '0'), ('dumps', '*')),)
    """
    return kept_per_object(_ROOTS, (code,), None, lambda: _root_chains(code))


def _root_chains(code: Any) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """:func:`root_chains`, made anew: each root followed, then each local or cell it is kept
    in, until no new one is found (a local kept in another)."""
    found: set[tuple[tuple[str, ...], tuple[str, ...]]] = set()
    aliases: dict[Any, set[tuple[tuple[str, ...], tuple[str, ...]]]] = {}
    codes = [(each, list(dis.get_instructions(each))) for each in reached_code(code, None)]
    for each, ins in codes:
        for i in range(len(ins)):
            for root, k, prefix in _roots_at(each, ins, i, aliases, found):
                direct = root[0] == "global"
                _follow(each, ins, k, (root, prefix), found, aliases, direct)
    followed: set[Any] = set()
    while True:
        todo = [
            (each, ins, i, held)
            for each, ins in codes
            for i, op in enumerate(ins)
            if op.opname in _ALIAS_LOADS
            for held in aliases.get(_alias_key(each, op, loaded=True), ())
            if (id(each), i, held) not in followed
        ]
        if not todo:
            break
        for each, ins, i, held in todo:
            followed.add((id(each), i, held))
            _follow(each, ins, i + 1, held, found, aliases)
    for each, ins in codes:  # 3.13's first local of two loaded at once: used as it is
        for op in ins:
            if op.opname in _JOINED_LOADS:
                for root, chain in aliases.get((id(each), op.argval[0]), ()):
                    found.add((root, (*chain, "*")))
    return tuple(sorted(found))


#: The ops that load a local or cell a value may be kept in, and those that store one.
#: 3.13 joins a load with a load or a store (``LOAD_FAST_LOAD_FAST``, ``STORE_FAST_LOAD_FAST``):
#: the local loaded last is the one an attribute read may follow.
_ALIAS_LOADS = frozenset(
    {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_FAST_BORROW", "LOAD_FAST_LOAD_FAST",
     "STORE_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"}
)  # fmt: skip
_ALIAS_STORES = frozenset({"STORE_FAST", "STORE_DEREF", "STORE_FAST_LOAD_FAST"})
_JOINED_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})
#: The ops that load an argument (one, or two at once: the last one loaded is followed).
_ARGUMENT_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_BORROW"}) | _JOINED_LOADS


def _alias_key(code: Any, op: Any, loaded: bool = False) -> Any:
    """Where a local (of its code) or a cell (by name, across nested code) is kept; of a
    joined op, the local it stores first, or (``loaded``) the one it loads last."""
    name = op.argval
    if isinstance(name, tuple):
        name = name[-1] if loaded else name[0]
    return name if "DEREF" in op.opname else (id(code), name)


def _roots_at(
    code: Any, ins: list[Any], i: int, aliases: dict[Any, set[Any]], found: set[Any]
) -> list[tuple[tuple[str, ...], int, tuple[str, ...]]]:
    """The roots loaded at ``ins[i]``, each with where its chain goes on and its chain so far;
    an import's names are kept in their locals (``aliases``) here, the first argument of two
    loaded at once is a use (``found``)."""
    op = ins[i]
    if op.opname in _NAME_LOADS and op.argval in _IMPORTERS:
        return _imported_by_call(ins, i, found)
    if op.opname == "LOAD_CONST" and op.argval in _IMPORTERS:  # getattr(importlib, "import_module")
        found.add((("dynamic", str(op.argval)), ("*",)))
        return []
    if op.opname == "LOAD_GLOBAL":
        return [(("global", str(op.argval)), i + 1, ())]
    if op.opname == "LOAD_DEREF":
        return [(("cell", str(op.argval)), i + 1, ())]
    loaded = op.argval[-1] if op.opname in _JOINED_LOADS else op.argval
    if op.opname in _JOINED_LOADS and op.argval[0] in argument_names(code):
        found.add((("param", str(op.argval[0])), ("*",)))  # used as it is
    if op.opname in _ARGUMENT_LOADS and loaded in argument_names(code):
        roots: list[tuple[tuple[str, ...], int, tuple[str, ...]]]
        roots = [(("param", str(loaded)), i + 1, ())]
        after = ins[i + 1] if i + 1 < len(ins) else None
        if loaded == code.co_varnames[0] and after is not None and after.opname in _METHOD_LOADS:
            roots.append((("self", str(after.argval)), i + 2, ()))
        return roots
    if op.opname == "IMPORT_NAME" and i >= 2:
        _imported_names(code, ins, i, aliases)
    return []


def _imported_by_call(
    ins: list[Any], i: int, found: set[Any]
) -> list[tuple[tuple[str, ...], int, tuple[str, ...]]]:
    """The module ``ins[i]`` imports by a call (``importlib.import_module("pkg.settings")``, the
    package ``__import__("pkg.settings")`` gives), as an import of it; one by any other call
    (a name made at run time, more arguments) a ``("dynamic", name)`` use in ``found``."""
    op = ins[i]
    called = _import_call(ins, i)
    if called is None:
        found.add((("dynamic", str(op.argval)), ("*",)))
        return []
    name, k = called
    bound = name.partition(".")[0] if op.argval == "__import__" else name
    return [(("import", bound, "0"), k, ())]


#: The functions by which code imports a module by its name as a string, and the ops that may
#: load one (a global, ``importlib``'s attribute, a local of ``import importlib as il``).
_IMPORTERS = frozenset({"import_module", "__import__"})
_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD"})
#: Ops between a call's last argument and the call that move nothing.
_CALL_PREFIXES = frozenset({"PRECALL", "KW_NAMES", "CACHE", "EXTENDED_ARG"})


def _import_call(ins: list[Any], i: int) -> tuple[str, int] | None:
    """Where ``ins[i]`` loads ``importlib.import_module`` or ``__import__`` called at once with
    one constant absolute name (``import_module("pkg.settings")``): the name and the index
    after the call; None where it is called otherwise or not at once."""
    rest = [
        (j, o) for j, o in enumerate(ins[i + 1 : i + 8], i + 1) if o.opname not in _CALL_PREFIXES
    ]
    if len(rest) < 2:
        return None
    (_, const), (j, call) = rest[0], rest[1]
    named = const.opname == "LOAD_CONST" and isinstance(const.argval, str)
    if not named or const.argval.startswith(".") or call.opname != "CALL" or call.arg != 1:
        return None
    return const.argval, j + 1


def _imported_names(code: Any, ins: list[Any], i: int, aliases: dict[Any, set[Any]]) -> None:
    """The locals an import at ``ins[i]`` binds, kept as aliases of the module imported:
    ``import a.b.c as x`` binds ``a.b.c``, ``import a.b`` binds ``a``, ``from a import X as
    y`` binds ``("X",)`` of ``a`` (relative ones by their level)."""
    level, fromlist = ins[i - 2].argval, ins[i - 1].argval
    name = str(ins[i].argval)
    if not isinstance(level, int):
        return
    j = i + 1
    if fromlist:
        while j + 1 < len(ins) and ins[j].opname == "IMPORT_FROM":
            if ins[j + 1].opname in _ALIAS_STORES:
                held: tuple[tuple[str, ...], tuple[str, ...]]
                held = (("import", name, str(level)), (str(ins[j].argval),))
                aliases.setdefault(_alias_key(code, ins[j + 1]), set()).add(held)
            j += 2
        return
    as_form = j < len(ins) and ins[j].opname == "IMPORT_FROM"
    while j < len(ins) and ins[j].opname in ("IMPORT_FROM", "SWAP", "POP_TOP"):
        j += 1
    if j < len(ins) and ins[j].opname in _ALIAS_STORES:
        bound = name if as_form else name.partition(".")[0]
        whole: tuple[tuple[str, ...], tuple[str, ...]] = (("import", bound, str(level)), ())
        aliases.setdefault(_alias_key(code, ins[j]), set()).add(whole)


def _follow(
    code: Any,
    ins: list[Any],
    k: int,
    held: tuple[tuple[str, ...], tuple[str, ...]],
    found: set[Any],
    aliases: dict[Any, set[Any]],
    direct: bool = False,
) -> None:
    """Follow a value (``held``: its root and chain so far) from ``ins[k]``: its attribute
    loads, then where it goes: kept in a local or cell (a walrus too), read by ``getattr``
    with a constant name, or used otherwise (``"*"``). ``direct``: a global just loaded,
    whose chain :func:`attribute_chains` gives (only its keeping and its bare use are
    added)."""
    root, prefix = held
    names = tuple(itertools.takewhile(lambda o: o.opname in _METHOD_LOADS, ins[k:]))
    chain = prefix + tuple(str(o.argval) for o in names)
    j = k + len(names)
    _taken_from_sys_modules(code, ins, j, root, chain, found, aliases)
    op = ins[j] if j < len(ins) else None
    if op is not None and not names and _getattr_of(ins, k):
        if not direct:
            found.add((root, (*chain, str(op.argval))))
        return
    walrus = op is not None and op.opname == "COPY" and op.arg == 1 and j + 1 < len(ins)
    if walrus and ins[j + 1].opname in _ALIAS_STORES:  # (cfg := config).GAIN
        aliases.setdefault(_alias_key(code, ins[j + 1]), set()).add((root, chain))
        _follow(code, ins, j + 2, (root, chain), found, aliases)
        return
    if op is not None and op.opname in _ALIAS_STORES:
        aliases.setdefault(_alias_key(code, op), set()).add((root, chain))
        if chain and not direct:
            found.add((root, chain))
    elif not direct:
        found.add((root, (*chain, "*")))
    elif not names:
        found.add((("bare", root[1]), ("*",)))


def _taken_from_sys_modules(
    code: Any,
    ins: list[Any],
    j: int,
    root: tuple[str, ...],
    chain: tuple[str, ...],
    found: set[Any],
    aliases: dict[Any, set[Any]],
) -> None:
    """Where a value followed to ``ins[j]`` (``root``, ``chain``) may be ``sys.modules``
    (``sys.modules`` of a global or of ``import sys``; a global itself, ``from sys import
    modules``), what is taken out of it, as a ``("sysmodules", global, via, kind, name)``
    root (read with the function's globals, :func:`_sys_modules_root`): a module by a
    constant name (``sys.modules["pkg.settings"]``, ``.get("pkg.settings"[, default])``) or
    the function's own (``[__name__]``) followed on as an import of it; by any other key, or
    ``sys.modules`` used otherwise (``.values()``, passed on), a ``"dynamic"`` use. Kept in a
    local, it is followed there; a membership test reads no module. ``sys`` itself used
    whole (passed on: ``helper(sys)``, ``getattr(sys, "modules")``) and a global used whole
    that is ``sys.modules`` (``from sys import modules``; ``helper(modules)``) are
    ``"dynamic"`` uses too. The value is followed on as it is too (a global that is no
    ``sys`` after all: each root names the global, checked against its value when read)."""
    if not chain and (root == ("import", "sys", "0") or root[0] == "global"):
        _sys_used_whole(ins, j, root, found)
    if root == ("import", "sys", "0") and chain[:1] == ("modules",):
        via, name, rest = "import", "", chain[1:]
    elif root[0] == "global" and chain[:1] == ("modules",):
        via, name, rest = "sys", root[1], chain[1:]
    elif root[0] == "global" and (not chain or chain[0] in _SYS_MODULES_READS):
        via, name, rest = "dict", root[1], chain
    else:
        return
    op = ins[j] if j < len(ins) else None
    if not rest and op is not None and (op.opname in _ALIAS_STORES or op.opname == "COPY"):
        return  # kept in a local: followed where it is loaded
    if not rest and op is not None and op.opname == "CONTAINS_OP":
        return
    taken: tuple[str, str, int] | None = None
    if rest == ("get",):
        taken = _got_module(ins, j)
    elif not rest:
        taken = _subscripted_module(ins, j, strict=via != "dict")
    if taken is None and via == "dict" and not rest:
        if _getattr_of(ins, j) and str(ins[j].argval) not in _SYS_MODULES_READS:
            return  # getattr(modules, "keys"): names, no module
        taken = "dynamic", "", j  # passed on, or used otherwise: sys.modules where it is
    kind, module, k = taken or ("dynamic", "", j)
    held = (("sysmodules", name, via, kind, module), ())
    if kind == "dynamic":
        found.add((held[0], ("*",)))
    else:
        _follow(code, ins, k, held, found, aliases)


def _sys_used_whole(ins: list[Any], j: int, root: tuple[str, ...], found: set[Any]) -> None:
    """Where ``sys`` (``import sys`` in the code, or a global that may be it) loaded before
    ``ins[j]`` is used whole: kept in a local (followed there), an attribute read by
    ``getattr`` with a constant name other than ``modules`` (read as that attribute), a
    membership test, or nothing; otherwise (``helper(sys)``, ``getattr(sys, "modules")``,
    ``getattr(sys, name)``) a ``"dynamic"`` root, which refuses the code where it is
    ``sys``."""
    op = ins[j] if j < len(ins) else None
    if op is None or op.opname in _ALIAS_STORES or op.opname in ("COPY", "CONTAINS_OP"):
        return
    if _getattr_of(ins, j) and op.argval != "modules":
        return
    via, name = ("import", "") if root[0] == "import" else ("sys", root[1])
    found.add((("sysmodules", name, via, "dynamic", ""), ("*",)))


#: What code may read of ``sys.modules`` (as a global of ``from sys import modules``) other
#: than by a subscript: each a way to take modules out of it by a name no reading knows.
_SYS_MODULES_READS = frozenset(
    {"get", "values", "items", "copy", "pop", "setdefault", "__getitem__"}
)


def _subscripted_module(ins: list[Any], j: int, strict: bool) -> tuple[str, str, int] | None:
    """What a subscript of the mapping loaded before ``ins[j]`` takes: ``("name", module,
    k)`` for a constant name, ``("own", "", k)`` for ``__name__`` (``k`` the index after
    the subscript), ``("dynamic", "", j)`` for any other key (a subscript within a few ops,
    or, ``strict``, any other use at all); None for no subscript."""
    at = ins[j : j + 2]
    if len(at) == 2 and _is_subscript(at[1]):
        key = at[0]
        if key.opname == "LOAD_CONST" and isinstance(key.argval, str):
            return "name", key.argval, j + 2
        if key.opname in ("LOAD_GLOBAL", "LOAD_NAME") and key.argval == "__name__":
            return "own", "", j + 2
    if strict or any(_is_subscript(o) for o in ins[j : j + 6]):
        return "dynamic", "", j  # sys.modules[name], sys.modules[prefix + ".settings"]
    return None


def _got_module(ins: list[Any], j: int) -> tuple[str, str, int]:
    """What a ``.get`` loaded just before ``ins[j]`` takes: ``("name", module, k)`` where
    it is called at once with a constant name (and at most one more argument, a default
    loaded by one op), ``k`` the index after the call; ``("dynamic", "", j)`` otherwise."""
    rest = [(n, o) for n, o in enumerate(ins[j : j + 8], j) if o.opname not in _CALL_PREFIXES]
    if len(rest) >= 2:
        (_, key), (n, after) = rest[0], rest[1]
        named = key.opname == "LOAD_CONST" and isinstance(key.argval, str)
        if named and after.opname == "CALL" and after.arg == 1:
            return "name", key.argval, n + 1
        if named and len(rest) >= 3 and after.opname.startswith("LOAD_"):
            n, call = rest[2]
            if call.opname == "CALL" and call.arg == 2:
                return "name", key.argval, n + 1
    return "dynamic", "", j


def _is_subscript(op: Any) -> bool:
    """Whether ``op`` takes an item (``BINARY_SUBSCR``; 3.14's ``BINARY_OP`` ``[]``)."""
    return op.opname == "BINARY_SUBSCR" or (op.opname == "BINARY_OP" and op.argrepr == "[]")


def _sys_modules_root(root: tuple[str, ...], found: Mapping[str, Any]) -> tuple[str, Any] | None:
    """A ``("sysmodules", global, via, kind, name)`` root of :func:`_taken_from_sys_modules`
    read with a function's globals ``found``: the name and module it takes (as
    :func:`imported_module` gives an import of it), ``("", None)`` for a ``"dynamic"`` use;
    None where the global is no ``sys`` (or its ``modules``) after all."""
    _, name, via, kind, module = root
    value = found.get(name)
    if (via == "sys" and value is not sys) or (via == "dict" and value is not sys.modules):
        return None
    if kind == "dynamic":
        return "", None
    if kind == "own":
        module = str(found.get("__name__") or "")
    return imported_module(("import", module, "0"), found)


def _getattr_of(ins: list[Any], k: int) -> bool:
    """Whether the value loaded just before ``ins[k]`` is ``getattr``'s first argument and a
    constant name its second (``getattr(cfg, "GAIN"[, default])``)."""
    op = ins[k]
    named = op.opname == "LOAD_CONST" and isinstance(op.argval, str)
    return (
        named and k >= 2 and ins[k - 2].opname == "LOAD_GLOBAL" and ins[k - 2].argval == "getattr"
    )


def global_root_chains(code: Any) -> tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]:
    """:func:`root_chains` rooted at a global or an import, as a function's globals are read
    at each forward; kept per code object."""
    return kept_per_object(
        _ROOTS,
        (code,),
        "globals",
        lambda: tuple(
            c
            for c in root_chains(code)
            if c[0][0] in ("global", "bare", "import", "dynamic", "sysmodules")
        ),
    )


#: root_chains's, by code object (:func:`kept_per_object`).
_ROOTS: dict[Any, Any] = {}


#: The process's settings a hook may read in the standard library (module, attribute): keyed
#: by value, as a global of the user's is (``os.environ``, ``os.getenv``: the variables read).
PROCESS_SETTINGS = frozenset({("os", "environ"), ("os", "getenv"), ("sys", "argv")})


def _own_module(value: Any) -> bool:
    """Whether ``value`` is a module of the user's own code (:func:`is_own_namespace`)."""
    return isinstance(value, types.ModuleType) and is_own_namespace(value)


def _reach(
    base: str,
    value: Any,
    chain: tuple[str, ...],
    reached: dict[str, Any],
    wholes: dict[str, Any],
    absent: bool = False,
) -> None:
    """Add what a :func:`root_chains` chain from ``value`` (named ``base``) reaches: the
    value at its end under its dotted name (:func:`reached_attribute`) to ``reached``, or,
    where that is a module of the user's the code uses other than by attribute (``"*"``),
    the module to ``wholes``; nothing where the chain leads into no namespace of the
    user's, or ends at ``base`` itself (read as a global). ``absent``: a missing attribute
    is added as ``_ABSENT``."""
    use = chain[-1:] == ("*",)
    path = chain[:-1] if use else chain
    name = base
    if path:
        if not leads_on(value, path[0]):
            return
        name, value = reached_attribute(base, value, path)
    if _own_module(value):
        if use:
            wholes.setdefault(name, value)
    elif name != base and (value is not _ABSENT or absent):
        reached.setdefault(name, value)


def _root_reads(
    code: Any,
    found: Mapping[str, Any],
    kept: frozenset[str],
    reached: dict[str, Any],
    wholes: dict[str, Any],
) -> frozenset[str]:
    """What a function's code (globals ``found``, its bookkeeping ``kept``) reads through a
    global or an import kept in a local or used at once (:func:`global_root_chains`), or a
    module it takes out of ``sys.modules`` by name, into ``reached`` and ``wholes``
    (:func:`_reach`); what it is refused as: a module imported by a name no reading knows
    (:data:`IMPORTED_AT_RUN_TIME`), one taken out of ``sys.modules`` so
    (:data:`TAKEN_FROM_SYS_MODULES`)."""
    refusals: set[str] = set()
    for root, chain in global_root_chains(code):
        if root[0] == "dynamic":
            refusals.add(IMPORTED_AT_RUN_TIME)
        elif root[0] == "sysmodules":
            taken = _sys_modules_root(root, found)
            if taken is not None and taken[1] is None:
                refusals.add(TAKEN_FROM_SYS_MODULES)
            elif taken is not None:
                _reach(*taken, chain, reached, wholes)
        elif root[0] == "bare":  # a global used at once: only a module of the user's counts
            value = found.get(root[1])
            if isinstance(value, types.ModuleType) and root[1] not in kept:
                _reach(root[1], value, chain, reached, wholes)
        elif root[0] == "global" and root[1] not in kept and root[1] in found:
            _reach(root[1], found[root[1]], chain, reached, wholes)
        elif root[0] == "import":
            _reach(*imported_module(root, found), chain, reached, wholes)
    return frozenset(refusals)


#: What a function that imports a module by a name made at run time (``import_module(name)``,
#: ``__import__(name, ...)``) is refused as: no reading knows which module's settings it reads.
IMPORTED_AT_RUN_TIME = (
    "a module imported by a name made at run time (importlib.import_module or __import__ "
    "with no constant name), whose settings no key reads"
)


#: What a function that takes a module out of ``sys.modules`` by a name made at run time
#: (``sys.modules[name]``, ``.get(name)``) or reads it otherwise (``.values()``, passed on) is
#: refused as, as :data:`IMPORTED_AT_RUN_TIME` is.
TAKEN_FROM_SYS_MODULES = (
    "a module taken out of sys.modules by a name made at run time (sys.modules[name], "
    ".get(name), .values(), or sys.modules or sys passed on), whose settings no key reads"
)


def _holds_importer(value: Any) -> bool:
    """Whether a global is ``importlib.import_module`` or ``__import__`` under another name
    (``IMPORT = importlib.import_module``), or a plain container holding one: what it imports
    no reading knows (:data:`IMPORTED_AT_RUN_TIME`). A container past :data:`HELD_VALUES`
    items is not looked through (a reading refuses it as too large): a watch asks at each
    forward, and a vocabulary of 100,000 entries cost 200 ms a call."""
    importers = (importlib.import_module, __import__)
    if type(value) in (list, tuple, set, frozenset, dict):
        if len(value) > HELD_VALUES:
            return False
        items = value.values() if isinstance(value, dict) else value
        return any(v is f for v in items for f in importers)
    return any(value is f for f in importers)


def imported_module(root: tuple[str, ...], found: Mapping[str, Any]) -> tuple[str, Any]:
    """The name and module of an import in a function (a :func:`root_chains` root
    ``("import", name, level)``, relative to the package of ``found``, a function's
    globals): the module loaded, or the user's own one imported now (as the function will at
    its first run, so its first key is its last); ``_ABSENT`` where it is neither."""
    package = found.get("__package__") or ""
    name = _absolute(root[1], int(root[2]), package) or root[1]
    module = sys.modules.get(name)
    if module is None:
        try:
            spec = importlib.util.find_spec(name)
            origin = spec.origin if spec is not None else None
            if origin and _own_source(name.partition(".")[0], origin):
                module = importlib.import_module(name)
        except (ImportError, ValueError, AttributeError):
            module = None
    return name, _ABSENT if module is None else module


def reached_attribute(name: str, value: Any, chain: tuple[str, ...]) -> tuple[str, Any]:
    """The dotted name and value a global ``name`` of ``value`` leads to through ``chain``,
    followed while it passes through the user's own modules and classes
    (:func:`is_own_namespace`) or names a process setting (:data:`PROCESS_SETTINGS`), each
    attribute as :func:`namespace_attribute` gives it; ``_ABSENT`` where one is none.

    Example:
        >>> import os
        >>> reached_attribute("os", os, ("environ", "get"))[0]
        'os.environ'
    """
    for part in chain:
        setting = isinstance(value, types.ModuleType) and (value.__name__, part) in PROCESS_SETTINGS
        if not setting and not is_own_namespace(value):
            break
        value = namespace_attribute(value, part)
        name = f"{name}.{part}"
        if value is _ABSENT:
            break
    return name, value


def leads_on(value: Any, name: str) -> bool:
    """Whether reading attribute ``name`` of a global ``value`` may reach what a key reads:
    ``value`` is the user's module or class (:func:`is_own_namespace`), or a module whose
    ``name`` is a process setting (:data:`PROCESS_SETTINGS`). Kept per module or class and
    name, as a watch reads at every forward (a hook calling ``F.relu`` reads ``torch`` once);
    any other value (data, an object) leads nowhere by its attributes (it is read as a
    global itself).

    Example:
        >>> import os
        >>> leads_on(os, "environ"), leads_on(os, "path"), leads_on({"a": 1}, "get")
        (True, False, False)
    """
    if not isinstance(value, (types.ModuleType, type)):
        return False
    return bool(kept_per_object(_LEADS, (value,), name, lambda: _leads_on(value, name)))


def _leads_on(value: Any, name: str) -> bool:
    """:func:`leads_on`, made anew."""
    setting = isinstance(value, types.ModuleType) and (value.__name__, name) in PROCESS_SETTINGS
    return setting or is_own_namespace(value)


#: leads_on's, by module or class and name (:func:`kept_per_object`).
_LEADS: dict[Any, Any] = {}


def namespace_attribute(namespace: Any, name: str) -> Any:
    """``namespace.name`` as it is, running no code: a module's global, a class's attribute
    (searched through its bases), a static method as its function, a class method bound to
    the class; ``_ABSENT``
    where there is none or it is another descriptor (a property: code, read by the code
    rule)."""
    if isinstance(namespace, types.ModuleType):
        return namespace.__dict__.get(name, _ABSENT)
    try:
        found = inspect.getattr_static(namespace, name)
    except AttributeError:
        return _ABSENT
    return class_value(namespace, found)


def class_value(namespace: Any, found: Any) -> Any:
    """What :func:`namespace_attribute` gives for ``found``, an attribute of the class
    ``namespace`` as ``inspect.getattr_static`` finds it."""
    if isinstance(found, classmethod):
        return types.MethodType(found.__func__, namespace)  # reads cls.GAIN: its class's
    if isinstance(found, staticmethod):
        return found.__func__
    if type(found) is not types.FunctionType and hasattr(type(found), "__get__"):
        return _ABSENT
    return found


def is_own_namespace(value: Any) -> bool:
    """Whether ``value`` is a module of the user's own code (the script run, a module from
    no file of the standard library's or installed packages' folders, nor of
    :data:`UNVERSIONED`; one made at run time with no file, a notebook's ``__main__``, but a
    builtin module or a namespace package), or a class defined in one: what a hook's code
    reaches through it by name is followed as a global of its own.

    Example:
        >>> is_own_namespace(json), is_own_namespace(dict)
        (False, False)
    """
    if isinstance(value, type):
        value = sys.modules.get(value.__module__)
    if not isinstance(value, types.ModuleType):
        return False
    top = value.__name__.partition(".")[0]
    where = getattr(value, "__file__", None)
    if not isinstance(where, str):  # a notebook's, `python -c`'s, a folder with no __init__
        library = top in UNVERSIONED or top in sys.stdlib_module_names
        if library or value.__name__ in sys.builtin_module_names:
            return False
        folders = [str(p) for p in getattr(value, "__path__", ())]
        return all(_own_source(top, f) for f in folders)  # a namespace package: each folder
    return bool(kept_per_object(_OWN_MODULES, (value,), where, lambda: _own_source(top, where)))


#: is_own_namespace's, by module and file (:func:`kept_per_object`).
_OWN_MODULES: dict[Any, Any] = {}


#: How an object whose attributes are read as they are reads them.
_GENERIC_READS = (object.__getattribute__, types.SimpleNamespace.__getattribute__)


def _plain_object(value: Any) -> bool:
    """Whether ``value`` keeps its state in attributes read as they are: an object with a
    ``__dict__`` or slots, no container, whose class reads attributes the usual way (no
    ``__getattr__``, ``__getattribute__`` of its own; ``SimpleNamespace``'s is the generic
    one): its fields are what a read names."""
    cls = type(value)
    plain_reads = cls.__getattribute__ in _GENERIC_READS
    return (
        _has_attributes(value)
        and plain_reads
        and inspect.getattr_static(cls, "__getattr__", None) is None
        and not isinstance(value, (Mapping, tuple, list, set, frozenset, enum.Enum))
    )


def global_tensor_digest(value: torch.Tensor | np.ndarray, *, exact: bool = False) -> str:
    """SHA-256 of a tensor or array a hook's code (or a helper's) reads as a global (a
    window, a mean and std): its kind, dtype, shape and every value, as a buffer of the
    module is keyed. A watch reads it at each forward, so it is made anew only where its
    stamp (its id, version, pointer, dtype, shape and device; an array's id, pointer, dtype,
    shape and strides) changed, or where ``exact`` (a key, a check before misses: an edit
    behind the version counter, or of an array, which keeps none, is seen there)."""
    stamp = _tensor_stamp(value)
    kept = _GLOBAL_TENSORS.get(id(value))
    if not exact and kept is not None and kept[0]() is value and kept[1] == stamp:
        return str(kept[2])
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        header = canonical_json(["array", array.dtype.str, list(array.shape)])
        digest = hashlib.sha256(header + b"\0" + array.view(np.uint8).data).hexdigest()
    else:
        digest = state_dict_fingerprint([("tensor", value)], "global-tensor")
    key = id(value)

    def forget(ref: weakref.ref[Any]) -> None:
        if _GLOBAL_TENSORS.get(key, (None,))[0] is ref:
            del _GLOBAL_TENSORS[key]

    _GLOBAL_TENSORS[key] = (weakref.ref(value, forget), stamp, digest)
    return digest


def _dense(tensor: torch.Tensor) -> bool:
    """Whether a tensor's values are dense bytes a key can read (strided, not meta, quantized
    or nested)."""
    plain = not (tensor.is_meta or tensor.is_quantized or tensor.is_nested)
    return tensor.layout is torch.strided and plain


def _tensor_stamp(value: torch.Tensor | np.ndarray) -> tuple[Any, ...]:
    """What :func:`global_tensor_digest` reads of a tensor or array at each forward."""
    if isinstance(value, np.ndarray):
        return (value.__array_interface__["data"][0], value.dtype.str, value.shape, value.strides)
    return (_version(value), value.data_ptr(), value.dtype, value.shape, value.device)


#: id of a tensor or array -> (a weak reference to it, its stamp, its digest):
#: global_tensor_digest's (a tensor's ``==`` is by element, so no weak-key dict can hold it).
_GLOBAL_TENSORS: dict[int, tuple[Any, tuple[Any, ...], str]] = {}


#: global_names's, by code object (:func:`kept_per_object`).
_GLOBAL_NAMES: dict[Any, Any] = {}


def instance_attributes(obj: Any) -> list[tuple[str, Any]]:
    """``(name, value)`` of an object's attributes, private ones too (``self._factor``: all a
    hook object's instance state matters; "public only" is for a module's attributes), in its
    ``__dict__`` and its slots (a slot never set left out), sorted by name."""
    attrs = getattr(obj, "__dict__", None)
    out = dict(attrs) if isinstance(attrs, dict) else {}
    for slot in _slot_names(type(obj)):
        try:
            out.setdefault(slot, object.__getattribute__(obj, slot))
        except AttributeError:
            continue
    return sorted(out.items())


def _runs(hook: Any) -> Any:
    """The function a hook object runs (its class's ``__call__``), None where it has none."""
    return inspect.getattr_static(type(hook), "__call__", None)


def held_values(hook: Any, *, exact: bool = False) -> list[str]:
    """What a hook holds that changes what it does, as one reading (:class:`HeldReading`)
    reads it: its code, and every value it holds by value, recursively; what its own code
    keeps as bookkeeping (a call counter, a log it appends to) left out, neither keyed nor
    watched. A watch compares it at each forward of a hooked module, so a dict the hook
    reads, edited in place, is a change. ``exact``: a global module it reads is hashed anew
    (:class:`HeldReading`), as a key reads it.

    Example:
        >>> import functools
        >>> held_values(functools.partial(round, ndigits=2))
        ['partial(builtin(round,),ndigits=2)']
    """
    return [HeldReading(exact=exact).text(hook)]


def held_refusals(hook: Any, own: frozenset[int] | set[int] = frozenset()) -> list[str]:
    """What a hook holds that no key can read (:class:`HeldReading`'s :attr:`refused`):
    tensors, arrays and modules not in ``own``, values too large to key; named."""
    reading = HeldReading(own)
    reading.text(hook)
    return reading.refused


def code_digest(code: Any) -> str:
    """SHA-256 of a code object's bytecode, names and constants (:func:`canonical_constant`:
    nested code objects by their own digest, a frozenset in sorted order): two lambdas of one
    line with other constants differ, and one function has one digest in every process."""
    consts = [canonical_constant(c) for c in code.co_consts]
    h = hashlib.sha256(code.co_code)
    h.update(json.dumps([consts, list(code.co_names)]).encode())
    return h.hexdigest()


def canonical_constant(const: Any) -> str:
    """A code object's constant as the same text in every process: a nested code object by
    its :func:`code_digest`, a frozenset (a set literal tested with ``in``: its repr order
    follows ``PYTHONHASHSEED``) by its items' texts sorted, a tuple by its items' texts; each
    written as its repr is, so a constant without a frozenset keeps the text it had.

    Example:
        >>> canonical_constant(frozenset({"b", "a"})), canonical_constant((1,))
        ("frozenset({'a', 'b'})", '(1,)')
    """
    if inspect.iscode(const):
        return code_digest(const)
    if isinstance(const, frozenset):
        items = ", ".join(sorted(map(canonical_constant, const)))
        return f"frozenset({{{items}}})" if const else "frozenset()"
    if isinstance(const, tuple):
        items = ", ".join(map(canonical_constant, const))
        return f"({items},)" if len(const) == 1 else f"({items})"
    return repr(const)


def cached_code_digest(code: Any) -> str:
    """:func:`code_digest`, kept per code object (by id, the object held so its id is not
    lent): a watch reads the code of the functions a hook holds at every forward."""
    return str(kept_per_object(_CODE_DIGESTS, (code,), None, lambda: code_digest(code)))


#: cached_code_digest's, by code object (:func:`kept_per_object`).
_CODE_DIGESTS: dict[Any, Any] = {}


def hook_code(hook: Any) -> str:
    """A hook's code: the qualified name of what runs, its bytecode (:func:`code_digest`) and
    its source file (:func:`code_identity`); a partial's or bound method's by its function, a
    decorated function's by the function it wraps (its wrapper's code and what it holds are
    read by :func:`held_values`). A hook of the script run is named ``__main__``'s in a
    spawned worker too."""
    func = hook.func if isinstance(hook, functools.partial) else hook
    func = func.__func__ if inspect.ismethod(func) else func
    func = unwrapped(func) if inspect.isfunction(func) else func
    runs = (
        func if inspect.isfunction(func) else inspect.getattr_static(type(func), "__call__", None)
    )
    named = getattr(func, "__qualname__", type(func).__qualname__)
    owner = getattr(func, "__module__", None) or type(func).__module__
    owner = "__main__" if owner == "__mp_main__" else owner
    code = code_digest(runs.__code__) if inspect.isfunction(runs) else ""
    source = code_identity(func, func if inspect.isfunction(func) else type(func))
    return f"{owner}.{named}:{code}:{source}"


#: torch's hooks run on every module's forward (``register_module_forward_pre_hook``, ``_hook``).
GLOBAL_HOOKS = (torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks)


def foreign_global_hooks() -> list[Any]:
    """torch's global forward hooks now but those of library machinery
    (:func:`is_library_machinery`: ``FlopCounterMode``'s and ``ModuleTracker``'s, which
    observe and change no output, as torch's module hooks are left out of keys) and a watch's
    own."""
    return [
        h
        for d in GLOBAL_HOOKS
        for h in d.values()
        if not is_library_machinery(h) and not getattr(h, "featbake_bookkeeping", False)
    ]


def hook_identity(module: Any) -> str:
    """SHA-256 of the forward hooks of every submodule, each by where it is, its code
    (:func:`hook_code`) and what it holds (:func:`held_values`), and of torch's global forward
    hooks present (:func:`foreign_global_hooks`: they run on this module's forward too);
    ``""`` where there is none. Hooks of library machinery (:func:`is_library_machinery`:
    ``weight_norm``, ``spectral_norm``, transformers' output capturing) and those marked
    ``featbake_bookkeeping`` (a watch's own) are left out, so a module carrying only those
    keeps the identity it had.

    A pre-hook that scales the input changes every output without changing code, weights or
    attributes: it must change the key, and so must the factor a partial or closure holds. Read
    when a module is fingerprinted only; a watch compares the hook objects themselves.

    Example:
        >>> hook_identity(torch.nn.Linear(2, 2))
        ''
    """
    rows = [
        [name, kind, hook_code(hook), held_values(hook, exact=True)]
        for name, kind, hook in forward_hooks(module)
        if not is_library_machinery(hook)
    ]
    globals_ = foreign_global_hooks()
    rows += [["<global>", "", hook_code(h), held_values(h, exact=True)] for h in globals_]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest() if rows else ""


def module_identity(module: Any) -> str:
    """An in-process module's identity: class, repr, code, plain attributes, its forward
    hooks where it has any (:func:`hook_identity`) and the globals its forward reads where it
    reads any (:func:`forward_globals`; neither: the identity it always had).

    Shared by :func:`from_module` and :class:`featbake.cached_encoder.CachedEncoder`, so the same
    module gets the same fingerprint either way.
    """
    ident = f"module:{type(module).__module__}.{type(module).__qualname__}\n{module!r}"
    ident = f"{ident}\ncode:{code_identity(module)}\nattrs:{attribute_identity(module)}"
    script = script_tree_identity(module)
    ident = f"{ident}\nscript:{script}" if script else ident
    hooks = hook_identity(module)
    ident = f"{ident}\nhooks:{hooks}" if hooks else ident
    left_out: list[tuple[type, str]] = []
    read = forward_globals(module, exact=True, left_out=left_out)
    warn_left_out(left_out)
    return f"{ident}\nglobals:{hashlib.sha256(read.encode()).hexdigest()}" if read else ident


def canonical_graph(graph: str) -> str:
    r"""A TorchScript graph's text as the program it is, whatever else the process compiled:
    without the ``# file.py:line:col`` each node ends with (a line moved in the source),
    TorchScript's ``___torch_mangle_N.`` in type names (numbered by what the process scripted
    before: the same module scripted after another made another key) and a traced graph's
    tensor types (``Float(2, 4, strides=[4, 1], requires_grad=0, device=cpu)``: the example
    input's shape, its grad mode, the device), each read as ``Tensor``.

    Example:
        >>> canonical_graph(
        ...     "  %9 : Float(2, 4, strides=[4, 1], device=cpu) = aten::relu(%8) # /m.py:3:1\n"
        ...     "  %l : __torch__.___torch_mangle_5.M = prim::GetAttr[name=\"l\"](%self)\n"
        ... )
        '  %9 : Tensor = aten::relu(%8)\n  %l : __torch__.M = prim::GetAttr[name="l"](%self)\n'
    """
    graph = _SOURCE_RANGE.sub("", graph)
    graph = _MANGLE.sub("", graph)
    return _TENSOR_TYPE.sub("Tensor", graph)


#: The source range a TorchScript graph's node is printed with.
_SOURCE_RANGE = re.compile(r" # [^\n]*:\d+:\d+$", re.MULTILINE)
#: TorchScript's numbering of a type compiled again under a name already taken.
_MANGLE = re.compile(r"___torch_mangle_\d+\.")
#: A tensor type with its dtype, sizes, strides, grad mode or device (a traced graph's).
_TENSOR_TYPE = re.compile(
    r"(?<!::)\b(?:Float|Double|Half|BFloat16|Long|Int|Short|Char|Byte|Bool|UInt\d+|Int\d+"
    r"|Complex\w+|Float8_\w+|QInt\w+|QUInt\w+)\([^()\n]*\)"
)


def script_tree_identity(module: Any) -> str:
    """SHA-256 of the TorchScript in an in-process ``module``'s tree: each scripted or traced
    submodule's methods' code (and, for the outermost ones, their graphs with every call
    inlined, which hold those of the modules inside: a module-level function a method calls
    is in no method's code) and the tensors their graphs hold as constants
    (``torch.jit.freeze`` makes its weights constants: it keeps no parameter); ``""`` for a
    tree holding none (its identity
    as it always was). Its class is torch's (``RecursiveScriptModule``), which
    :func:`code_identity` leaves out, and its repr names only the class it was made from: two
    modules of other code (``relu`` for ``tanh``) or other frozen weights were keyed alike.
    (A TorchScript file is keyed by its archive: :func:`script_identity`.)"""
    if not hasattr(module, "named_modules"):
        return ""
    h = hashlib.sha256()
    found = False
    outermost = {name for name, _, _ in outermost_scripts(module)}
    for name, sub in module.named_modules():
        if not isinstance(sub, torch.jit.ScriptModule):
            continue
        found = True
        for method in sorted(sub._c._method_names()):
            compiled = sub._c._get_method(method)
            h.update(f"{name}.{method}\0{compiled.code}\0".encode())
            if name in outermost:  # every call inlined: also the functions no method's code is
                h.update(f"{canonical_graph(str(compiled.inlined_graph))}\0".encode())
            for node in compiled.graph.findAllNodes("prim::Constant", True):
                if node.output().type().kind() == "TensorType":
                    value = node.t("value").detach().cpu().contiguous()
                    h.update(f"{value.dtype}{list(value.shape)}".encode())
                    h.update(tensor_buffer(value))
    return h.hexdigest() if found else ""


class KeyLeftOutWarning(UserWarning):
    """What a module's forward reads that no key can read (:func:`warn_left_out`)."""


def warn_left_out(left_out: Iterable[tuple[type, str]]) -> None:
    """Say once per process, for each ``(class, what)`` a module's forward reads that its key
    left out (:meth:`HeldReading._refuse`'s: a global adapter with forward hooks of its own
    or in train mode, a table past :data:`HELD_VALUES`), that a change to it changes no key:
    features stored before the change would be served after it. Not in a process
    ``multiprocessing`` started (a ``DataLoader`` worker: its parent said it, and a spawned
    worker reads the key while it unpickles, before it knows it is one); the line points at
    the user's code that called featbake."""
    if _in_a_child_process():
        return
    for cls, what in left_out:
        said = (cls, what)
        if said in _LEFT_OUT_SAID:
            continue
        _LEFT_OUT_SAID.add(said)
        warnings.warn(
            KeyLeftOutWarning(
                f"the forward of {cls.__qualname__} reads {what}, which no key can read: a "
                "change to it changes no key, so features stored before it would be served "
                f"after it; {left_out_advice(what)}"
            ),
            stacklevel=user_stacklevel(),
        )


def _in_a_child_process() -> bool:
    """Whether this is a ``DataLoader`` worker, or a process ``multiprocessing`` is starting
    (a spawned worker unpickling its dataset: ``_inheriting``, before it knows it is a
    worker): its parent said what it would say. A rank ``torch.multiprocessing.spawn``
    started says it for itself, as any process does."""
    from torch.utils.data import get_worker_info

    inheriting = getattr(multiprocessing.current_process(), "_inheriting", False)
    return get_worker_info() is not None or bool(inheriting)


def left_out_advice(what: str) -> str:
    """What to do about a value a forward reads that no key can read (:func:`warn_left_out`).

    Example:
        >>> left_out_advice(TOO_LARGE)
        'build into a new store (another --cache) after changing it'
    """
    if IN_TRAIN_MODE in what:
        return "call .eval() on it"
    if "forward hooks of its own" in what:
        return "make it a submodule of the encoder (its hooks are then keyed as the encoder's)"
    if "tensor" in what or "array" in what:
        return "make it a buffer of the encoder (keyed by its values)"
    return "build into a new store (another --cache) after changing it"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning its caller raises point at the first frame
    outside featbake and torch (the user's code: ``cached(x)`` runs through torch's module
    call), not at their files."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_THE_USERS):
        frame, level = frame.f_back, level + 1
    return level


#: featbake's and torch's own folders (user_stacklevel's).
_NOT_THE_USERS = tuple(
    str(Path(m.__file__).resolve().parent) + os.sep
    for m in (sys.modules[__name__.partition(".")[0]], torch)
    if m.__file__
)


#: What :func:`warn_left_out` said in this process.
_LEFT_OUT_SAID: set[tuple[type, str]] = set()


def forward_functions(module: Any) -> tuple[tuple[type, Any], ...]:
    """:func:`forward_functions_and_calls`' functions."""
    return forward_functions_and_calls(module)[0]


def forward_functions_and_calls(module: Any) -> tuple[tuple[tuple[type, Any], ...], Calls]:
    """What a module's key reads the globals and class settings of (:func:`forward_globals`):
    for each submodule's class of the user's (:func:`reads_held_attributes`: a library's
    classes read library globals, versioned by the library), its ``forward`` and every method
    of the class it reaches by name (:func:`reached_methods`: ``self.scale(x)``), and the
    ``forward`` of each base class of the user's (``super().forward(x)``) with what it reaches,
    each ``(class, function)`` once, in the tree's order; then a method of a submodule's class
    another class's code calls (``self.heads.fast(y)``, ``b.custom(y)``: :func:`calls_in`),
    in the order found. A function of the user's set on a library's class (``nn.Linear.forward =
    patched``: :func:`library_patches`) is read with each class of the tree it reaches. An
    instance's own ``forward`` is read otherwise (refused while it differs). Beside them, the
    :class:`Calls` they make (what a reading of any of them takes for the forward's own
    state: :func:`forward_state`)."""
    subs = list(module.modules()) if hasattr(module, "modules") else [module]
    every = list(dict.fromkeys(type(sub) for sub in subs))
    classes = [cls for cls in every if not is_library_code(cls)]
    found: dict[tuple[type, Any], None] = {}
    calls = Calls({}, frozenset())
    while True:
        for cls in classes:
            for f in _methods_run(cls, called=calls.names(cls)):
                found.setdefault((cls, f), None)
        more = calls_in(subs, found)
        picked = [picks_at_run_time(f, c).held for c, f in found if not is_library_code(f)]
        if any(picked):  # getattr(self.heads, "fast_" + mode): heads' class runs fast_*
            shapes = frozenset().union(*picked)
            held = {n for cls in classes for n in _fitting(own_names(cls), shapes, True)}
            more = Calls(more.surely, more.maybe | held)
        if all(more.names(cls) <= calls.names(cls) for cls in classes):
            break
        calls = more
    read: dict[type, tuple[Any, ...]] = {}  # each library class read once a key
    for cls in every:
        for f in library_patches(cls, read):
            found.setdefault((cls, f), None)
    return tuple(found), calls_in(subs, found)


def library_patches(cls: type, read: dict[type, tuple[Any, ...]] | None = None) -> tuple[Any, ...]:
    """The functions of the user's the library's classes in ``cls``'s MRO hold
    (:func:`functions_held`: ``nn.Linear.forward = patched``, a transformers attention's
    forward replaced by the user's), with the methods of ``cls`` each reaches, and those its
    library forward calls through a module (:func:`functions_patched_in`): what the library
    runs is the user's code there, which the library's version does not answer for (keyed
    by its code and what it reads, :func:`forward_reads`). ``read``: what each library class
    was found to hold in this reading, kept there."""
    read = {} if read is None else read
    for k in _library_bases(cls):
        if k not in read:
            read[k] = _patched_on(k)
    held = [f for k in _library_bases(cls) for f in read[k]]
    reached = dict.fromkeys(m for f in held for m in reached_methods(f, cls))
    return tuple(dict.fromkeys([*reached, *functions_patched_in(cls)]))


def _library_bases(cls: type) -> tuple[type, ...]:
    """The library's classes in ``cls``'s MRO but ``object`` (which no script patches),
    kept per class."""
    return kept_per_object(
        _LIBRARY_BASES,
        (cls,),
        cls.__mro__,
        lambda: tuple(k for k in cls.__mro__ if k is not object and is_library_code(k)),
    )


#: _library_bases's, by class and MRO (:func:`kept_per_object`).
_LIBRARY_BASES: dict[Any, Any] = {}


def _patched_on(k: type) -> tuple[Any, ...]:
    """The functions of the user's the library class ``k`` holds itself; kept per class and
    the ids of what it holds (one class read once however many classes of the tree it is a
    base of)."""
    state = tuple(map(id, vars(k).values()))
    return kept_per_object(_PATCHES, (k,), state, lambda: _patched_found(k))  # ~2 us a class


#: _patched_on's, by class and state (:func:`kept_per_object`).
_PATCHES: dict[Any, Any] = {}


def _patched_found(k: type) -> tuple[Any, ...]:
    """:func:`_patched_on`, made anew."""
    found: dict[Any, None] = {}
    for attr in vars(k).values():
        if type(attr) not in _PLAIN_TYPES:
            found.update(dict.fromkeys(f for f in functions_held(attr) if is_own_code(f)))
    return tuple(found)


def functions_patched_in(cls: type) -> tuple[Any, ...]:
    """The functions of the user's a library class's ``forward`` calls through a library
    module's attribute or a global (``F.gelu = my_gelu``, ``torch.nn.functional.
    scaled_dot_product_attention = patched``): read at each key, since no class changes
    where a module's attribute is bound anew. Only the forward's own calls (a library
    function it calls that calls a patched one is not followed)."""
    forward = inspect.getattr_static(cls, "forward", None)
    if type(forward) is not types.FunctionType or not is_library_code(forward):
        return ()
    places = kept_per_object(_PLACES, (forward.__code__,), None, lambda: _places_read(forward))
    values = (where.get(name) for where, name in places)
    return tuple(
        dict.fromkeys(v for v in values if type(v) is types.FunctionType and is_own_code(v))
    )


#: _places_read's, by code object (:func:`kept_per_object`).
_PLACES: dict[Any, Any] = {}


def _places_read(func: Any) -> tuple[tuple[Mapping[str, Any], str], ...]:
    """Where the library function ``func`` reads what it calls, as ``(namespace, name)``: its
    globals, and the module each chain of attributes it reads through modules ends in
    (``F.gelu``: torch.nn.functional's namespace and ``"gelu"``); read again at each key."""
    found = func.__globals__
    places: list[tuple[Mapping[str, Any], str]] = [(found, g) for g in global_names(func.__code__)]
    for g, chain in attribute_chains(func.__code__):
        places += [(where, part) for where, part, _ in _through_modules(found.get(g), chain)]
    return tuple(places)


def _through_modules(
    value: Any, chain: tuple[str, ...]
) -> Iterator[tuple[Mapping[str, Any], str, Any]]:
    """``(namespace, name, value)`` of each attribute of ``chain`` read from ``value`` while
    what is read from is a module (``F.gelu``: torch.nn.functional's namespace, ``"gelu"``
    and the function)."""
    for part in chain:
        if not isinstance(value, types.ModuleType):
            return
        where = vars(value)
        value = where.get(part)
        yield where, part, value


def patched_in_library(base: str, value: Any, chain: tuple[str, ...]) -> tuple[str, Any]:
    """``(dotted name, function)`` where the chain of attributes ``chain`` read from the
    library module ``value`` (named ``base``) reaches through modules a function of the
    user's (``F.gelu = my_gelu``: ``("F.gelu", my_gelu)``), keyed as a helper of the user's
    is; ``(name, None)`` where it reaches none."""
    steps = list(_through_modules(value, chain))
    name = ".".join([base, *(part for _, part, _ in steps)])
    value = steps[-1][2] if steps else None  # act.__name__: a global, read as one
    return name, value if type(value) is types.FunctionType and is_own_code(value) else None


@dataclass(frozen=True)
class Calls:
    """The methods of a module tree's classes that another class's code calls by name:
    ``surely``, by class, where the call names the submodule it runs on (``self.heads.fast(y)``,
    ``self.blocks[0].fast(y)``: run as surely as the forward's own methods); ``maybe`` where
    it is made on a value whose class no reading knows (``for b in self.blocks:
    b.custom(y)``, ``out.update(...)``): any class's method of that name is read, but only what
    it bumps is the forward's own state (a ``Head.update`` classmethod setting ``cls.scale``
    beside a dict's ``update`` is a setter)."""

    surely: Mapping[type, frozenset[str]]
    maybe: frozenset[str]

    def names(self, cls: type) -> frozenset[str]:
        """The names ``cls``'s methods may be called by."""
        return self.surely.get(cls, frozenset()) | self.maybe


def calls_in(subs: Iterable[Any], functions: Iterable[tuple[type, Any]]) -> Calls:
    """:class:`Calls` of the user's functions among ``functions`` (``(class, function)``),
    over the modules of the tree ``subs``: a call on ``self.<sub>`` is resolved to the class of
    what each instance of the calling class holds there (and of its children, where that is
    a library's container: ``nn.ModuleList``, ``nn.Sequential``)."""
    surely: dict[type, set[str]] = {}
    maybe: set[str] = set()
    sites = {
        (cls, site)
        for cls, f in functions
        if not is_library_code(f)
        for site in kept_per_object(_CALLED, (f.__code__,), None, lambda f=f: _call_sites(f))
    }
    instances = [s for s in subs if hasattr(s, "__dict__")]
    for cls, (sub, name) in sites:
        if not sub:
            maybe.add(name)
            continue
        held = [h for inst in instances if type(inst) is cls for h in _held_as(inst, sub)]
        for each in held:
            surely.setdefault(type(each), set()).add(name)
        if not held:  # a property, a plain list: no reading knows the class
            maybe.add(name)
    return Calls({k: frozenset(v) for k, v in surely.items()}, frozenset(maybe))


def _held_as(inst: Any, sub: str) -> list[Any]:
    """The modules ``inst`` holds as ``sub`` (a submodule or a plain attribute): it, with its
    children where it is a container of modules (``nn.ModuleList``, ``nn.Sequential``,
    ``nn.ModuleDict`` or a subclass: ``self.blocks[0].fast(y)``); nothing where it is no
    module (a property, a list: the call is read as one on a value of no known class)."""
    modules = vars(inst).get("_modules") or {}
    held = modules.get(sub) if sub in modules else vars(inst).get(sub)
    if not isinstance(held, torch.nn.Module):
        return []
    containers = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
    return [held, *held.children()] if isinstance(held, containers) else [held]


#: calls_in's call sites, by code object (:func:`kept_per_object`).
_CALLED: dict[Any, Any] = {}


def _call_sites(func: Any) -> frozenset[tuple[str, str]]:
    """The methods ``func``'s code calls on another object than its own, as ``(submodule,
    name)``: ``("heads", "fast")`` for ``self.heads.fast(y)`` and ``self.heads[0].fast(y)``,
    ``("", "custom")`` where the object is not an attribute of the first argument
    (``b.custom(y)``)."""
    found: set[tuple[str, str]] = set()
    for code in reached_code(func.__code__, None):
        ins = list(dis.get_instructions(code))
        for i, op in enumerate(ins):
            if op.opname not in _METHOD_LOADS:
                continue
            sub = _submodule_before(code, ins, i)  # self.blk.custom, called or passed on
            if sub is not None:
                found.add((sub, str(op.argval)))
            elif _calls_a_method(op) and not _loads_own_object_at(code, ins, i - 1):
                found.add(("", str(op.argval)))
    return frozenset(found)


def _calls_a_method(op: Any) -> bool:
    """Whether ``op`` loads a method to call it (3.11's ``LOAD_METHOD``; from 3.12 a
    ``LOAD_ATTR`` with its method flag)."""
    if op.opname == "LOAD_METHOD":
        return True
    return sys.version_info >= (3, 12) and op.opname == "LOAD_ATTR" and bool(op.arg & 1)


def _submodule_before(code: Any, ins: list[Any], i: int) -> str | None:
    """The attribute of the first argument the method loaded at ``ins[i]`` is called on
    (``self.heads.fast``, ``self.heads[0].fast``: ``"heads"``), or None."""
    for start, subscripted in ((i - 2, False), (i - 4, True)):
        if start < 0 or _own_object_end(code, ins, start) != start + 1:
            continue
        if ins[start + 1].opname not in _METHOD_LOADS or ins[start + 1].argval == "__class__":
            continue
        if not subscripted or (
            ins[start + 2].opname == "LOAD_CONST" and ins[start + 3].opname == "BINARY_SUBSCR"
        ):
            return str(ins[start + 1].argval)
    return None


def _loads_own_object_at(code: Any, ins: list[Any], j: int) -> bool:
    """Whether ``ins[j]`` loads the code's object or class (``self.fast(y)``: its own)."""
    return j >= 0 and _own_object_end(code, ins, j) == j + 1


def _methods_run(
    cls: type, *, any_name: bool = True, called: frozenset[str] = frozenset()
) -> list[Any]:
    """The functions of ``cls``'s own classes (not a library's) its ``forward`` may run:
    each of theirs named ``forward``, and each named as an attribute that code reaches loads
    (``self.scaled(x)``; a base class's ``scaled`` a subclass's runs through
    ``super().scaled(x)``, which reaching by name alone finds as the subclass's own; one
    asked by ``getattr(self, "scaled")``; a helper of the user's given ``self``,
    ``_apply(self, x)`` or ``helpers.apply(self, x)`` calling ``m.scaled(x)``; a library
    base class's method those names reach, ``nn.Conv1d.forward`` calling the user's
    ``_conv_forward`` override, at any depth), with what each reaches
    (:func:`reached_methods`), until no more are found; the user's ``__call__``, the
    function of a ``partialmethod`` and what a wrapper made without ``functools.wraps``
    holds (:func:`functions_held`); the methods of the user's classes whose names fit one
    asked for by a name made at run time (:func:`picks_at_run_time`; with ``any_name``
    false, not those a pick of any name alone reaches); those named ``called`` (run by
    another class's code: :func:`calls_in`). Kept per class and :func:`class_layout`."""
    state = (class_layout(cls), _own_callables(cls))
    extra = (state, any_name, called)
    return list(kept_per_object(_RUN, (cls,), extra, lambda: _methods_found(cls, any_name, called)))


def _own_callables(cls: type) -> tuple[int, ...]:
    """The ids of what the user's classes in ``cls``'s MRO hold (:func:`own_class_values`):
    a method replaced at run time (``Cls.post = scaled_post``) is another state of the class.
    The functions found are kept with the state, so no id of theirs is lent while it is
    kept."""
    return tuple(map(id, own_class_values(cls)))


def own_class_values(cls: type) -> list[Any]:
    """The methods the user's classes in ``cls``'s MRO hold (functions, static and class
    methods, properties): what a watch compares by identity at each forward, so a method
    replaced on the class is seen. Not their data (settings are read by value, a counter or
    a shape the forward keeps on its class changes at each call: compared by identity, a
    glance would never settle)."""
    return [
        v
        for k, mine in _own_in_mro(cls)
        if mine
        for v in vars(k).values()
        if type(v) is types.FunctionType
        or (type(v) not in _PLAIN_TYPES and (inspect.isroutine(v) or isinstance(v, _METHOD_KINDS)))
    ]  # a plain value, most of what a class holds but its functions, is no method: not asked


#: What a class holds as a method (own_class_values's), beside plain functions.
_METHOD_KINDS = (staticmethod, classmethod, property, functools.partialmethod)


#: _methods_run's, by class and layout (:func:`kept_per_object`).
_RUN: dict[Any, Any] = {}


def _methods_found(cls: type, any_name: bool, called: frozenset[str]) -> list[Any]:
    """:func:`_methods_run`, made anew. The user's ``__call__`` runs first, whatever the
    forward; a function wraps what its closure cells hold of the user's (a decorator made
    without ``functools.wraps``), and a ``partialmethod`` runs its function."""
    own = [k for k in cls.__mro__ if not is_library_code(k)]
    library = [k for k in cls.__mro__ if is_library_code(k)]
    names, found, library_read = {"forward", *called}, dict[Any, None](), set[Any]()
    while True:
        names |= _library_reaches(library, names, library_read)
        defined = [
            f
            for k in own
            for n, attr in vars(k).items()
            if n in names or n == "__call__"  # only the user's: nn.Module's reads no setting
            for f in functions_held(attr)
        ]
        new = [f for d in defined for f in reached_methods(d, cls) if f not in found]
        if not new:
            return list(found)
        found.update(dict.fromkeys(new))
        for f in new:
            names |= {n for code in reached_code(f.__code__, cls) for n in attribute_names(code)}
            if not is_library_code(f):  # a library's own code asks nothing of the user's
                names |= {*names_asked(f, cls), *helpers_attribute_names(f)}
                names |= picks_at_run_time(f, cls).names(cls, any_name=any_name)


def functions_held(attr: Any) -> list[Any]:
    """The functions a class attribute runs when called (:func:`~featbake.keys.
    method_function`: a method, a property's getter, a static or class method's function),
    the function a ``functools.partialmethod`` calls (``forward_fast = partialmethod(_run,
    scale=2.0)``), and those of the user's code a function holds in its closure cells (a
    decorator's wrapper made without ``functools.wraps`` calls the method it was given),
    in turn; each once."""
    found: dict[Any, None] = {}
    todo = [(attr, True)]
    while todo:
        now, direct = todo.pop()
        if isinstance(now, functools.partialmethod):
            todo.append((now.func, direct))
            continue
        func = method_function(now)
        if not inspect.isfunction(func) or func in found or not (direct or is_own_code(func)):
            continue
        found[func] = None
        todo += [(held, False) for held in _cell_values(func) if _runnable(held)]
    return list(found)


def _runnable(value: Any) -> bool:
    """Whether a closure cell's value is a function or ``partialmethod`` a wrapper may run."""
    return type(value) is types.FunctionType or isinstance(value, functools.partialmethod)


def _cell_values(func: Any) -> list[Any]:
    """What ``func``'s closure cells hold (an empty cell left out)."""
    held = []
    for cell in func.__closure__ or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:
            continue
    return held


def _library_reaches(library: list[type], names: set[str], read: set[Any]) -> set[str]:
    """The attribute names the library classes' methods of ``names`` use, and those theirs
    use in turn (``nn.Conv1d.forward`` uses ``_conv_forward``; timm's ``forward`` uses
    ``forward_features``, which uses ``_pos_embed``): where a user's override a library
    method calls is found. ``read``: the code objects read already (updated)."""
    found: set[str] = set()
    todo = set(names)
    while todo:
        more: set[str] = set()
        for klass in library:
            for name in todo & vars(klass).keys():
                func = method_function(vars(klass)[name])
                if inspect.isfunction(func) and func.__code__ not in read:
                    read.add(func.__code__)
                    more |= {
                        n for c in reached_code(func.__code__, None) for n in attribute_names(c)
                    }
        todo = more - names - found
        found |= todo
    return found


def helpers_attribute_names(func: Any) -> frozenset[str]:
    """The names the user's helpers ``func`` calls by a global or through a module of the
    user's (:func:`followed_helper`: ``_apply(self, x)``, ``helpers.apply(self, x)``), and
    theirs in turn, use as attributes (``m.scaled(x)``, ``m.SCALE``): where a method or class
    setting of the module's class read through a helper given ``self`` is found. Kept per
    code object."""
    return kept_per_object(_HELPER_NAMES, (func.__code__,), None, lambda: _helper_names(func))


#: helpers_attribute_names's, by code object (:func:`kept_per_object`).
_HELPER_NAMES: dict[Any, Any] = {}


def _helper_names(func: Any) -> frozenset[str]:
    """:func:`helpers_attribute_names`, made anew."""
    return frozenset(
        n
        for helper in helpers_reached(func)
        for c in reached_code(helper.__code__, None)
        for n in attribute_names(c)
    )


def helpers_reached(func: Any) -> tuple[Any, ...]:
    """The user's helpers ``func`` calls (:func:`_helpers_called`), and theirs in turn, each
    once. Kept per code object."""
    return kept_per_object(_HELPERS, (func.__code__,), None, lambda: _helpers_reached(func))


#: helpers_reached's, by code object (:func:`kept_per_object`).
_HELPERS: dict[Any, Any] = {}


def _helpers_reached(func: Any) -> tuple[Any, ...]:
    """:func:`helpers_reached`, made anew."""
    found: dict[Any, None] = {}
    todo, seen = [func], set[Any]()
    while todo:
        now = todo.pop()
        if now.__code__ in seen:
            continue
        seen.add(now.__code__)
        for helper in _helpers_called(now):
            found.setdefault(helper, None)
            todo.append(helper)
    return tuple(found)


def _helpers_called(func: Any) -> list[Any]:
    """The user's functions ``func``'s code reaches by a global or through the user's
    modules and classes (``helpers.apply``), as :meth:`HeldReading._globals` reaches them."""
    helpers = (followed_helper(v) for _, v in reached_by_globals(func))
    return [h for h in helpers if type(h) is types.FunctionType]


def reached_by_globals(func: Any) -> list[tuple[str, Any]]:
    """Each global ``func``'s code reads, and each attribute it reaches by name through the
    user's modules and classes (:func:`attribute_chains`, :func:`reached_attribute`:
    ``helpers.apply``, ``ops.gelu``), by its (dotted) name, with what it holds now (``None``
    for a global not bound)."""
    found = func.__globals__
    out = [(g, found.get(g)) for g in globals_named(func)]
    for g, chain in attribute_chains(func.__code__):
        if g in found and leads_on(found[g], chain[0]):
            out.append(reached_attribute(g, found[g], chain))
    return out


def forward_globals(
    module: Any,
    *,
    exact: bool,
    functions: Iterable[tuple[type, Any]] | None = None,
    left_out: list[tuple[type, str]] | None = None,
    calls: Calls | None = None,
) -> str:
    """The globals a module's forward reads, by the one rule a hook's are read by
    (:meth:`HeldReading.globals_read`: ``shared.STATE.scale``, a settings dict's items, a
    global tensor by its values, a global adapter by its state, the user's helper of another
    module by its code and the globals it reads in turn), and the settings its class holds
    that it reads as ``self.K`` or ``type(self).K`` where no instance attribute shadows them
    (:meth:`HeldReading.class_settings`), for each of ``functions`` (default
    :func:`forward_functions`) that reads any, by its qualified name; ``""`` where none does.
    The module's own submodules and tensors read as ``<own>`` (its key reads them). What no
    key can read (a global module with hooks of its own, a value too large) is named in the
    text, not refused: the rest is keyed as before. ``exact``: tensors and global modules
    hashed anew (a key; the check before misses), else trusted while their stamps hold (a
    watch, at each forward).

    A forward reading ``x * shared.STATE.scale`` (or ``x * self.SCALE``, ``Model.SCALE = 3.0``
    set on its class) changes its outputs when the setting does, with no code, weight or
    attribute of the module changed: a key must read it.

    Example:
        >>> forward_globals(torch.nn.Linear(2, 2), exact=True)
        ''
    """
    rows = forward_reads(module, exact=exact, functions=functions, left_out=left_out, calls=calls)
    return ";".join(row for _, row in rows)


def forward_reads(
    module: Any,
    *,
    exact: bool,
    functions: Iterable[tuple[type, Any]] | None = None,
    left_out: list[tuple[type, str]] | None = None,
    calls: Calls | None = None,
) -> list[tuple[tuple[type, Any], str]]:
    """:func:`forward_globals`' rows, each with the ``(class, function)`` it is of: those
    that read anything, in one reading (what a watch's plan keeps to read at each forward).
    ``left_out``: given, each ``(class, what)`` the reading could not key is added to it.
    ``calls``: those of all the module's forward functions (:func:`forward_functions_and_calls`;
    a watch reading some of them passes what its plan found, so its reading takes what
    a key's takes for the forward's own state)."""
    if functions is None:
        functions, calls = forward_functions_and_calls(module)
    functions = tuple(functions)
    if calls is None:
        calls = calls_in(module.modules() if hasattr(module, "modules") else [module], functions)
    reading = HeldReading(_TreeIds(module), exact=exact, forward=True)
    shadowed = instance_names(module)
    rows = []
    read_before: set[Any] = set()
    classes = dict.fromkeys(cls for cls, _ in functions)
    states = {
        cls: forward_state(cls, calls.surely.get(cls, frozenset()), calls.maybe) for cls in classes
    }
    for cls, func in functions:
        refused = len(reading.refused)
        reading.globals_written = states[cls].globals_written
        reading.globals_set_shapes = states[cls].globals_set_shapes
        read = [] if func in read_before else reading.globals_read(func)
        read_before.add(func)
        own = states[cls].class_written  # type(self)._fb = w, a class memo dict filled
        settings = reading.class_settings(cls, func, shadowed.get(cls, frozenset()) | own)
        read += [settings] if settings else []
        if left_out is not None:
            left_out += [(cls, what) for what in reading.refused[refused:]]
        if is_library_code(cls) and not is_library_code(func):  # nn.Linear.forward = patched
            read.insert(0, f"code={cached_code_digest(func.__code__)}")
        if read:
            owner = _script_named(func.__module__)
            named = f"{owner}.{func.__qualname__}@{cls.__qualname__}({','.join(read)})"
            rows.append(((cls, func), named))
    return rows


@dataclass(frozen=True)
class ForwardState:
    """What the functions a class's forward may run (:func:`_methods_run`) set as their own
    state, read back or not: the names set on the class or recorded into there
    (:func:`class_written_names`), and, by the id of a globals dict, the globals they set
    there (``global STEP; STEP += 1``, ``globals()["K"] = v``). One method's counter read by
    another (``report()`` reading ``type(self).calls``) is the forward's own, not a
    setting: keyed, each run would change the key. Of a method only a pick of any name
    reaches (``getattr(self, self.head)`` beside a ``set_scale`` classmethod), only what it
    bumps or records into (``type(self).calls += 1``) is its own: what it sets plainly
    (``cls.scale = s``, ``globals()["SCALE_" + mode] = v``) is a setting, read and keyed;
    so of a method called by name on a value of no known class (:attr:`Calls.maybe`)."""

    class_written: frozenset[str]
    globals_written: dict[int, frozenset[str]]
    #: By the id of a globals dict, the shapes of the names they set there by a name made at
    #: run time (:attr:`GlobalsAsked.set_shapes`).
    globals_set_shapes: dict[int, frozenset[tuple[str, ...]]] = field(default_factory=dict)


def forward_state(
    cls: type, called: frozenset[str] = frozenset(), maybe: frozenset[str] = frozenset()
) -> ForwardState:
    """:class:`ForwardState` of ``cls`` (``called`` and ``maybe``: the names another class's
    code calls its methods by surely and maybe, :class:`Calls`), kept per class, layout and
    methods held (as :func:`_methods_run`)."""
    state = (class_layout(cls), _own_callables(cls))
    extra = (state, called, maybe)
    make = lambda: _forward_state(cls, called, maybe)  # noqa: E731
    return kept_per_object(_FORWARD_STATE, (cls,), extra, make)


#: forward_state's, by class and state (:func:`kept_per_object`).
_FORWARD_STATE: dict[Any, Any] = {}


def _forward_state(cls: type, called: frozenset[str], maybe: frozenset[str]) -> ForwardState:
    """:func:`forward_state`, made anew."""
    names: set[str] = set()
    written: dict[int, set[str]] = {}
    shapes: dict[int, set[tuple[str, ...]]] = {}
    surely = _methods_run(cls, any_name=False, called=called)
    for func in dict.fromkeys([*surely, *_methods_run(cls, called=called | maybe)]):
        asked = globals_asked(func.__code__)
        by_global = written_names(func.__code__, GLOBAL_WRITES) | asked.written
        set_shapes = asked.set_shapes
        if func in surely:
            names |= class_written_names(func, cls)
        else:  # a setter beside a pick of any name: what it bumps is the forward's own
            names |= class_bumped_names(func, cls)
            by_global &= set(global_names(func.__code__))
            set_shapes = frozenset(s for s in set_shapes if known_part(s))  # "_seen_" + k
        shapes.setdefault(id(func.__globals__), set()).update(set_shapes)
        written.setdefault(id(func.__globals__), set()).update(by_global)
    return ForwardState(
        frozenset(names),
        {k: frozenset(v) for k, v in written.items()},
        {k: frozenset(v) for k, v in shapes.items()},
    )


def class_written_names(func: Any, cls: type) -> frozenset[str]:
    """The names ``func`` and the methods of ``cls`` it reaches set on the class
    (``type(self)._fb = w``, ``self.__class__.K = v``, ``Cls.K = v``, ``cls.K = v``) or record
    into (``self._windows[n] = w``, a memo dict on the class): the forward's own state, never
    its settings. An attribute set on another object (``self.stats.scale = self.scale``) is
    not the class's. Kept per code object and class."""
    return kept_per_object(
        _CLASS_WRITTEN, (func.__code__, cls), None, lambda: _class_written(func, cls)
    )


#: class_written_names's, by code object and class (:func:`kept_per_object`).
_CLASS_WRITTEN: dict[Any, Any] = {}


def _class_written(func: Any, cls: type, *, bumped_only: bool = False) -> frozenset[str]:
    """:func:`class_written_names`, made anew; with ``bumped_only``, only what is recorded
    into or set to a value computed from its own (:func:`_bumped_at`)."""
    found = func.__globals__
    names: set[str] = set()
    for code in reached_code(func.__code__, cls):
        ins = list(dis.get_instructions(code))
        for j, op in enumerate(ins):
            set_on_class = op.opname in ATTRIBUTE_WRITES and _a_class_at(ins, j, found, cls)
            if set_on_class and bumped_only and not _bumped_at(ins, j):
                continue
            if set_on_class or (op.opname in _ATTRIBUTE_READS and records_into(ins, j)):
                names.add(str(op.argval))
    return frozenset(names)


def class_bumped_names(func: Any, cls: type) -> frozenset[str]:
    """What ``func`` and the methods of ``cls`` it reaches count on the class
    (``type(self).calls += 1``, ``cls.n = cls.n + 1``: :func:`_bumped_at`) or record into (a
    memo dict): a counter or a cache, the forward's own state however the method is reached;
    a value set otherwise (``cls.scale = s``, ``cls.scale = cls.scale * f``, ``old, cls.scale
    = cls.scale, s``) is not. Kept per code object and class."""
    return kept_per_object(
        _CLASS_BUMPED,
        (func.__code__, cls),
        None,
        lambda: _class_written(func, cls, bumped_only=True),
    )


#: class_bumped_names's, by code object and class (:func:`kept_per_object`).
_CLASS_BUMPED: dict[Any, Any] = {}


def _bumped_at(ins: list[Any], j: int) -> bool:
    """Whether the attribute set at ``ins[j]`` is a counter: set to its own value plus or
    minus a constant (``x.n += 1``, ``x.n = x.n - 1``). Anything else set, from its own or
    not (``cls.scale = cls.scale * f``, a maximum, an average), may be a setter's: a setting,
    where the method setting it may never run (a pick of any name reaches it)."""
    before = [op for op in ins[max(0, j - 6) : j] if op.opname not in ("SWAP", "COPY")]
    ops = [(op.opname, op.argval, op.argrepr) for op in before]
    for k in range(len(ops) - 2):
        loaded, constant, operated = ops[k], ops[k + 1], ops[k + 2]
        if loaded[0] in _ATTRIBUTE_READS and loaded[1] == ins[j].argval:
            counted = constant[0] == "LOAD_CONST" and isinstance(constant[1], (int, float))
            if counted and operated[0] == "BINARY_OP" and operated[2] in ("+", "+=", "-", "-="):
                return True
    return False


def _a_class_at(ins: list[Any], j: int, found: Mapping[str, Any], cls: type) -> bool:
    """Whether the object an attribute is set on at ``ins[j]`` may be the class (``type(x)``,
    ``x.__class__``, ``cls``, a local holding one, a counter bumped, ``type(self).calls +=
    1``, whatever the interpreter's bytecode puts between): all but what is plainly another
    object, a field of an attribute (``self.stats.scale = v``) or a global that is no class
    of ``cls``'s (a namespace, a module, another class: ``Log.scale = v``)."""
    before = ins[j - 1] if j else None
    if before is None:
        return False
    if before.opname == "LOAD_ATTR":
        return before.argval == "__class__"
    if before.opname == "LOAD_GLOBAL":
        return found.get(str(before.argval)) in cls.__mro__
    return True


def instance_names(module: Any) -> dict[type, frozenset[str]]:
    """Each class in a module tree, and the names its instances there hold as attributes of
    their own (which shadow the class's: keyed as attributes, :func:`attribute_identity`)."""
    names: dict[type, set[str]] = {}
    for sub in module.modules() if hasattr(module, "modules") else [module]:
        names.setdefault(type(sub), set()).update(vars(sub))
    return {cls: frozenset(n) for cls, n in names.items()}


def script_identity(module: Any, path: Path) -> str:
    """Code of every submodule, plus the archive's code, pickled attributes and constants.

    A scripted module's ``.code`` is its ``forward`` alone, and shows no attribute values
    (``self.scale = 2.0``); the archive's ``code/`` files hold every method and every function
    it calls (``self.act(x)``, a module-level helper: a file whose helper changed from relu to
    tanh kept its key, and its old features were served), and its ``data.pkl`` and
    ``constants.pkl`` the attributes, whose bytes are the same each time one module is saved.
    The entries are named without their first folder, which is named after the file; the
    ``.debug_pkl`` beside each code file (source line numbers) is left out.
    """
    parts = [f"torchscript:{getattr(module, 'original_name', type(module).__name__)}"]
    for name, sub in sorted(module.named_modules(), key=lambda kv: kv[0]):
        code = getattr(sub, "code", "")
        parts.append(f"{name}\n{code}")
    with zipfile.ZipFile(path) as z:
        for entry in sorted(z.namelist()):
            inside = entry.partition("/")[2]
            if entry.endswith(("/data.pkl", "/constants.pkl")):
                parts.append(
                    f"{entry.rsplit('/', 1)[1]}:{hashlib.sha256(z.read(entry)).hexdigest()}"
                )
            elif inside.startswith("code/") and inside.endswith(".py"):
                code = canonical_script_code(z.read(entry).decode("utf-8", "replace"))
                parts.append(f"{inside}:{hashlib.sha256(code.encode()).hexdigest()}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def canonical_script_code(code: str) -> str:
    r"""A TorchScript archive's code file with each class's declarations (the lines before its
    first method: ``stride : Final[Tuple[int]] = (160,)``) in sorted order: torch writes a
    module's constants in the order of a set, which differs between processes, so the same
    module saved by two processes made two keys.

    Example:
        >>> canonical_script_code("class A(Module):\n  b : int\n  a : int\n  def f(self):\n")
        'class A(Module):\n  a : int\n  b : int\n  def f(self):\n'
    """
    out: list[str] = []
    header: list[str] = []
    for line in code.splitlines(keepends=True):
        if (header and not line.startswith("  ")) or line.startswith("  def "):
            out.extend(sorted(header))
            header = []
        if line.startswith("class "):
            out.append(line)
            header = [""]  # a class's declarations follow
            continue
        if header:
            header.append(line)
        else:
            out.append(line)
    out.extend(sorted(header))
    return "".join(out)


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


#: The installed roots, read once per process (what :func:`is_own_code` compares a file with).
_INSTALLED_ROOTS = functools.cache(_installed_roots)


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
        if top not in self.libraries:
            self.libraries[top] = installed_version(top)


def installed_version(top: str) -> str:
    """How a key counts the installed library imported as ``top``: each distribution that
    provides it with its version (``transformers==5.24.0``), or "unknown" when none names it."""
    dists = _distributions().get(top, [])
    versions = sorted(f"{d}=={importlib.metadata.version(d)}" for d in set(dists))
    return ",".join(versions) or "unknown"


def library_versions(names: Iterable[str]) -> dict[str, str]:
    """Each library in ``names`` (top-level import names) as a key counts it: its
    :func:`installed_version`, or "absent" when it cannot be imported here (an optional
    library a module uses only when it is there); the standard library and
    :data:`UNVERSIONED` are left out, as in a :class:`CodeClosure`."""
    found: dict[str, str] = {}
    for top in sorted(set(names)):
        if top in UNVERSIONED or top in sys.stdlib_module_names or top in sys.builtin_module_names:
            continue
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: finds, never imports
        except (ImportError, ValueError):
            spec = None
        found[top] = "absent" if spec is None else installed_version(top)
    return found


def imported_libraries(cls: type) -> set[str]:
    """The top-level names that the source of ``cls``'s module imports (anywhere in it: an
    optional library is imported inside a ``try``), read from the file, never run; none
    when the module has no source file."""
    module = sys.modules.get(cls.__module__)
    where = getattr(module, "__file__", None)
    if not where or not where.endswith(".py"):
        return set()
    path = Path(where)
    package = cls.__module__ if path.name == "__init__.py" else cls.__module__.rpartition(".")[0]
    return {name.partition(".")[0] for name in imported_names(path, package)}


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
