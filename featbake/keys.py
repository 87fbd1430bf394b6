"""Content addresses: what went in decides the key, nothing else.

``key = sha256(encoder_fp | recipe_fp | input_fp)`` where

* ``encoder_fp`` covers the encoder's architecture identity and every tensor of its state dict
  (name, dtype, shape and bytes), so one changed weight changes every key;
* ``recipe_fp`` covers everything between a file and its features (sample rate, crop, output
  selection, stored dtype, featbake's recipe version) as canonical JSON;
* ``input_fp`` is the SHA-256 of the raw file's bytes: a renamed or touched file keeps its key, and
  two copies of one file share one feature.

Batch sizes, worker counts, devices, paths and mtimes never enter a key (HF datasets #2496, #8439).
Keys are never shortened in storage: their soundness rests on SHA-256's collision resistance.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import dis
import enum
import functools
import hashlib
import heapq
import inspect
import json
import os
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # torch is imported where tensors are hashed: upkeep commands never load it
    import torch

KEY_HEX_LEN = 64
#: Bytes hashed per task when fingerprinting weights; hashlib releases the GIL on large buffers,
#: so chunks hash in parallel threads. The chunking is part of the fingerprint's definition.
WEIGHT_CHUNK_BYTES = 16 * 1024 * 1024


def canonical_json(obj: Any) -> bytes:
    """Serialise ``obj`` so that equal values always give equal bytes.

    Example:
        >>> canonical_json({"b": 1, "a": [1.5, None]})
        b'{"a":[1.5,null],"b":1}'
    """
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True
    ).encode()


def sha256_hex(data: bytes) -> str:
    """SHA-256 of ``data`` as 64 lowercase hex characters."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str] | int) -> str:
    """SHA-256 of a file's bytes (a path, or an open descriptor read from its position), streamed:
    the one file digest every input fingerprint, shard check and hash-cache check uses.

    Example:
        >>> sha256_file("/dev/null")
        'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'
    """
    if isinstance(path, int):
        with os.fdopen(os.dup(path), "rb", buffering=0) as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def item_digest(kind: str, *parts: object) -> str:
    """The digest of an item made from parts of an input (a segment of a file, a table cell).

    SHA-256 over ``featbake-item-v1``, the kind and each part as text, NUL-separated: a tag
    per kind, so no two kinds of item can share a digest by accident, and never a file's own
    digest (the same bytes as a whole file keep the file's key). Floats are written with
    as floats with ``repr`` (the shortest exact form: ``3`` and ``3.0`` are one bound), ``None``
    as an empty part.

    Example:
        >>> item_digest("segment", "ab" * 32, 1.5, 3.0, None)[:12]
        '2403c84b9d68'
    """
    text = "\0".join(["featbake-item-v1", kind, *(_part_text(p) for p in parts)])
    return sha256_hex(text.encode())


def _part_text(part: object) -> str:
    if part is None:
        return ""
    if isinstance(part, (int, float)) and not isinstance(part, bool):
        return repr(float(part))
    return str(part)


def feature_key(encoder_fp: str, recipe_fp: str, input_fp: str) -> str:
    """The store key of one input's features under one encoder and recipe.

    Example:
        >>> len(feature_key("a" * 64, "b" * 64, "c" * 64))
        64
    """
    return sha256_hex(f"{encoder_fp}|{recipe_fp}|{input_fp}".encode())


def recipe_fingerprint(recipe: Mapping[str, Any]) -> str:
    """SHA-256 of a recipe's canonical JSON (see :class:`featbake.recipe.Recipe`)."""
    return sha256_hex(canonical_json(dict(recipe)))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a tensor's values in C order, copying only if it is on a device or strided."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _chunks(view: memoryview, size: int) -> list[memoryview]:
    return [view[i : i + size] for i in range(0, len(view), size)] or [view]


def state_dict_fingerprint(
    tensors: Iterable[tuple[str, torch.Tensor]], identity: str, *, threads: int | None = None
) -> str:
    """Fingerprint an architecture identity and named tensors (a state dict), order-independent.

    Each tensor contributes its name, dtype, shape and the SHA-256 of each 16 MiB chunk of its
    bytes; the chunk digests are computed in parallel threads. Nothing is copied for contiguous
    CPU tensors.

    Args:
        tensors: ``(name, tensor)`` pairs, e.g. ``module.state_dict().items()``.
        identity: what names the architecture (TorchScript code, export graph, import path).
        threads: hashing threads (default: CPU count, at most 8).

    Returns:
        64 hex characters.
    """
    items = sorted(tensors, key=lambda kv: kv[0])
    views = [(name, t, _tensor_bytes(t)) for name, t in items]
    jobs = [chunk for _, _, view in views for chunk in _chunks(view, WEIGHT_CHUNK_BYTES)]
    workers = threads or min(8, os.cpu_count() or 1)
    if workers > 1 and sum(len(j) for j in jobs) > WEIGHT_CHUNK_BYTES:
        with ThreadPoolExecutor(workers) as pool:
            digests = iter(list(pool.map(lambda c: hashlib.sha256(c).digest(), jobs)))
    else:
        digests = iter([hashlib.sha256(c).digest() for c in jobs])
    top = hashlib.sha256(b"featbake-encoder-v1\0" + identity.encode() + b"\0")
    for name, t, view in views:
        header = canonical_json([name, str(t.dtype), list(t.shape)])
        top.update(len(header).to_bytes(8, "little") + header)
        for _ in _chunks(view, WEIGHT_CHUNK_BYTES):
            top.update(next(digests))
    return top.hexdigest()


def keyed_attribute(name: str) -> bool:
    """Whether an attribute called ``name`` may enter a key (a module's plain or tensor
    attribute, a hook object's, the watch's reads): a public one but ``training`` (always
    eval here); private ones are torch's own bookkeeping.

    Example:
        >>> keyed_attribute("scale"), keyed_attribute("_buffers"), keyed_attribute("training")
        (True, False, False)
    """
    return not name.startswith("_") and name != "training"


def module_fingerprint(module: torch.nn.Module, identity: str) -> str:
    """Fingerprint a module: ``identity`` plus every parameter and buffer, persistent or not,
    and every public tensor attribute that is neither (``self.scale = torch.tensor(2.0)``).

    Non-persistent buffers are included because they can change outputs too (e.g. a mel filter
    bank registered with ``persistent=False``); so can a plain tensor attribute, hashed as a
    buffer is under ``attribute:<submodule>.<name>`` (a module without one keeps its key).
    """
    named: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=False))
    for name, buf in module.named_buffers():
        named.setdefault(name, buf)
    for name, value in tensor_attributes(module):
        named.setdefault(f"attribute:{name}", value.detach())
    return state_dict_fingerprint(named.items(), identity)


def unsaved_state_fingerprint(module: torch.nn.Module) -> str:
    """A digest of what of ``module`` a weights file loaded into it does not hold: each saved
    tensor's name, dtype and shape (a default dtype of float64 at construction), and the
    values of its non-persistent buffers and public tensor attributes (a filter bank read from
    a file beside the code, a gain read from the environment at ``__init__``).

    An import-path encoder's fingerprint is cached against its identity and its weights
    file's stat (:func:`~featbake.encode.fingerprints.encoder_cache_id`): without this, a
    buffer its factory computed differently kept the fingerprint of the one first hashed.
    """
    saved = module.state_dict(keep_vars=False)
    shapes = [[name, str(t.dtype), list(t.shape)] for name, t in saved.items()]
    unsaved = {name: buf.detach() for name, buf in module.named_buffers() if name not in saved}
    for name, value in tensor_attributes(module):
        unsaved.setdefault(f"attribute:{name}", value.detach())
    return state_dict_fingerprint(unsaved.items(), canonical_json(shapes).decode())


def tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(submodule.name, tensor)`` of every submodule's public attribute
    (:func:`keyed_attribute`) that is a tensor and no parameter or buffer (those live in
    torch's own dicts, not in ``__dict__``), or a tensor inside a plain list, tuple or dict of
    one (``self.scales = [torch.tensor(2.0)]``, named ``scales.0``), but derived state its
    forward writes (:func:`derived_attributes`; for TorchScript :func:`script_forward_writes`)
    or torch's weight reparametrising pre-hooks write (:func:`reparametrised_attributes`)."""
    written = script_forward_writes(module)
    return [
        (f"{prefix}.{path}" if prefix else path, tensor)
        for prefix, sub in module.named_modules()
        for key, value in held_attributes(sub).items()
        if keyed_attribute(key)
        and not derived_state(module_derived(sub), key, value)
        and key not in reparametrised_attributes(sub)
        and (f"{prefix}.{key}" if prefix else key) not in written
        for path, tensor in contained_tensors(key, value)
    ]


def held_attributes(sub: torch.nn.Module) -> dict[str, Any]:
    """``sub``'s attributes that are neither parameters nor buffers nor submodules: its
    ``__dict__``, and a TorchScript module's scripted attributes (:func:`public_attributes`),
    where a plain tensor attribute lives (``self.gain = torch.full((8,), 2.0)`` scripted: a
    file saved with another gain kept its key, and its old features were served)."""
    attrs = public_attributes(sub)
    if attrs is vars(sub):
        return attrs
    buffers = dict(sub.named_buffers(recurse=False))
    return {k: v for k, v in attrs.items() if k not in buffers}


def script_forward_writes(module: torch.nn.Module) -> frozenset[str]:
    """The dotted paths (from ``module``) of the attributes the forward of each outermost
    TorchScript module in ``module``'s tree writes, the methods it calls included (its graph
    with every call inlined: ``prim::SetAttr`` on ``self`` or a submodule reached from it):
    state a forward derives (the last output kept, a position table grown to the longest
    input), which made a new key after every forward, as an eager module's derived state would
    without :func:`derived_attributes`. A method forward never calls (an exported setter) and
    an attribute of the same name elsewhere stay keyed. Read once per scripted module (its
    methods never change); empty for a tree holding no TorchScript."""
    out: set[str] = set()
    for prefix, sub, scripted in outermost_scripts(module):
        out |= {f"{prefix}.{path}" if prefix else path for path in _forward_writes(sub, scripted)}
    return frozenset(out)


def outermost_scripts(module: torch.nn.Module) -> list[tuple[str, Any, Any]]:
    """``(path, submodule, its compiled object)`` of each TorchScript module in ``module``'s
    tree that no other TorchScript module holds: its methods' graphs, every call inlined,
    hold those of the TorchScript modules inside it."""
    out: list[tuple[str, Any, Any]] = []
    for prefix, sub in module.named_modules():
        scripted = vars(sub).get("_c")  # a TorchScript module's compiled object (torch unread)
        if scripted is None or not hasattr(scripted, "_method_names"):
            continue
        if not any(prefix.startswith(f"{p}.") or not p for p, _, _ in out):
            out.append((prefix, sub, scripted))
    return out


def _forward_writes(sub: Any, scripted: Any) -> frozenset[str]:
    cached = _FORWARD_WRITES.get(sub)
    if cached is None:
        found: set[str] = set()
        if "forward" in scripted._method_names():
            graph = scripted._get_method("forward").inlined_graph
            paths: dict[int, tuple[str, ...]] = {next(graph.inputs()).unique(): ()}  # self
            _setattr_paths(graph.nodes(), paths, found)
        cached = _FORWARD_WRITES[sub] = frozenset(found)
    return cached


def _setattr_paths(
    nodes: Iterable[Any], paths: dict[int, tuple[str, ...]], found: set[str]
) -> None:
    """Add to ``found`` the attribute path each ``prim::SetAttr`` among ``nodes`` (and their
    blocks, in program order) writes, where its target is ``self`` or reached from it by
    ``prim::GetAttr`` (``paths``: value -> its path from self)."""
    for node in nodes:
        kind = node.kind()
        if kind in ("prim::GetAttr", "prim::SetAttr"):
            target = paths.get(next(node.inputs()).unique())
            if target is not None:
                path = (*target, node.s("name"))
                if kind == "prim::GetAttr":
                    paths[node.output().unique()] = path
                else:
                    found.add(".".join(path))
        for block in node.blocks():
            _setattr_paths(block.nodes(), paths, found)


#: What each scripted module's forward writes (:func:`script_forward_writes`), while it lives.
_FORWARD_WRITES: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()


def public_attributes(module: Any) -> dict[str, Any]:
    """A submodule's attributes as a key reads them: its ``__dict__``, and for a TorchScript
    module (``torch.jit.script`` in memory, or loaded) the attributes its scripted object
    keeps, which ``__dict__`` does not hold (``self.scale = 2.0``, set again by
    ``scripted.scale = 3.0``): each by its current value, parameters and submodules left
    out (they live in torch's own dicts).

    Example:
        >>> import torch
        >>> class Scaled(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.scale = 2.0
        ...
        ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
        ...         return x * self.scale
        >>> public_attributes(torch.jit.script(Scaled()))["scale"]
        2.0
    """
    attrs = vars(module)
    concrete = attrs.get("_concrete_type")
    scripted = attrs.get("_c")
    if concrete is None or scripted is None:
        return attrs
    found = dict(attrs)
    for name, (_, is_parameter) in concrete.get_attributes().items():
        if is_parameter or name in found or name in attrs.get("_modules", {}):
            continue
        found[name] = scripted.getattr(name)
    return found


def reparametrised_attributes(module: torch.nn.Module) -> frozenset[str]:
    """The attributes of ``module`` that torch's old-API ``spectral_norm`` or ``weight_norm``
    pre-hook sets at each forward (``weight``, from ``weight_orig`` and the ``weight_u`` /
    ``weight_v`` buffers, or from ``weight_g`` and ``weight_v``): derived from parameters and
    buffers the key reads, a plain tensor attribute the first forward replaces (the raw weight
    copied at ``spectral_norm()``, then the normalised one), neither keyed nor watched.

    Example:
        >>> import torch
        >>> lin = torch.nn.utils.spectral_norm(torch.nn.Linear(2, 2))
        >>> sorted(reparametrised_attributes(lin)), reparametrised_attributes(torch.nn.Linear(2, 2))
        (['weight'], frozenset())
    """
    hooks = vars(module).get("_forward_pre_hooks") or {}
    return frozenset(
        hook.name
        for hook in hooks.values()
        if type(hook).__module__ in _REPARAMETRISING
        and isinstance(getattr(hook, "name", None), str)
    )


#: torch's modules whose pre-hook objects set a weight from its parametrisation at each forward.
_REPARAMETRISING = frozenset({"torch.nn.utils.spectral_norm", "torch.nn.utils.weight_norm"})


def contained_tensors(name: str, value: Any, depth: int = 0) -> list[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` of ``value`` where it is a tensor, or of each tensor inside it where
    it is a plain list, tuple or dict (``name.0``, ``name.key``), to a few levels deep."""
    import torch  # loaded already: a module is fingerprinted

    if isinstance(value, torch.Tensor):
        return [(name, value)]
    if depth >= 4:
        return []
    if type(value) in (list, tuple):
        items = list(enumerate(value))
    elif type(value) is dict:
        items = list(value.items())
    else:
        return []
    return [found for k, v in items for found in contained_tensors(f"{name}.{k}", v, depth + 1)]


#: The containers a forward may keep as derived state: a log it records into, a table it makes.
_LOGS = (list, dict, collections.deque)


def derived_state(derived: frozenset[str], key: str, value: Any) -> bool:
    """Whether attribute ``key`` holding ``value`` is derived state, left out of keys and
    watches: one the forward writes or records into (``derived``: :func:`derived_attributes`)
    holding a tensor, a list, dict or deque (a log of attention maps), or None (a lazy table
    not made yet). A number the forward writes (a call counter) is not: it stays keyed and
    watched as before (a change made outside a run is refused).

    Example:
        >>> derived_state(frozenset({"pe", "calls"}), "pe", None)
        True
        >>> derived_state(frozenset({"pe", "calls"}), "calls", 3)
        False
    """
    if key not in derived:
        return False
    return value is None or type(value).__module__.startswith("torch") or type(value) in _LOGS


def derived_attributes(cls: type) -> frozenset[str]:
    """The attributes a module class's forward writes (``STORE_ATTR`` in ``forward``, the
    code nested in it and every method of the class it reaches: :func:`reached_code`), as a
    positional table extended to the longest input seen (ESPnet's, WeNet's, icefall's
    ``extend_pe``): derived state, a function of the input, neither keyed nor watched, or the
    key would follow the forwards run. An attribute set at construction or by the user stays
    keyed. Kept per class.

    Example:
        >>> class Lazy:
        ...     def forward(self, x):
        ...         self.extend(len(x))
        ...
        ...     def extend(self, n):
        ...         self.pe = list(range(n))
        >>> sorted(derived_attributes(Lazy))
        ['pe']
    """
    kept = _DERIVED.get(cls)
    if kept is not None:
        return kept
    code = forward_code(cls)
    fresh, called = _fresh_reading(code, cls)
    _CALLED[cls] = {a: frozenset(t[1] for t in ts) for a, ts in called.items()}
    _DERIVED[cls] = fresh | recorded_attributes(code)
    return _DERIVED[cls]


def module_derived(module: Any) -> frozenset[str]:
    """:func:`derived_attributes` of ``module``'s class, read with what the instance holds:
    an attribute whose writes are made by calling a callable one of its attributes holds
    (``self.reader()``, ``self.helper.current()``) is derived state only where each such
    attribute holds a submodule (its call is made of its inputs and its own keyed weights),
    a tensor, a plain value, or library code holding nothing (``torch.tanh``, a partial of
    ``F.gelu``); one holding a function of the user's, a partial or bound method holding the
    module, or any other object (which may read the module back) keeps it keyed. The answer
    every key, watch and glance reads."""
    cls = type(module)
    derived = derived_attributes(cls)
    sources = _CALLED.get(cls)
    if not sources:
        return derived
    return derived - {
        a for a, names in sources.items() if any(_runs_users_code(module, n) for n in names)
    }


def _runs_users_code(module: Any, name: str) -> bool:
    """Whether attribute ``name`` of ``module`` holds a callable that may run code of the
    user's reading the module (see :func:`module_derived`); a submodule, parameter or buffer
    does not."""
    try:
        attrs = vars(module)
    except TypeError:
        return True
    for table in ("_modules", "_parameters", "_buffers"):
        if name in (attrs.get(table) or {}):
            return False
    value = attrs.get(name, _MISSING)
    if value is _MISSING:
        value = inspect.getattr_static(type(module), name, None)
    if value is None:
        return False  # set later: a watch sees the change and reads it again
    return _holds(value) or _held_function(value)


def recorded_attributes(code: list[Any]) -> frozenset[str]:
    """The attributes the code objects only record into (:func:`records_into`:
    ``self.maps.append(out)``, ``self.log["last"] = out``) and read no other way: a log kept
    for a plot or a probe, a function of the inputs run, which changes no output. One also
    read for the output (``torch.cat(self.past)``, through a property or
    ``getattr(self, "past")``: a streaming model's state) is not; code that reads attributes
    by a name built at run time (``vars(self)``, ``self.__dict__``, ``getattr``) or hands
    ``self`` on (``helper(self)``) records into none.

    Example:
        >>> def forward(self, x):
        ...     self.maps.append(x)
        ...     self.past.append(x)
        ...     return sum(self.past)
        >>> sorted(recorded_attributes([forward.__code__]))
        ['maps']
    """
    recorded: set[str] = set()
    other: set[str] = set()
    for each in code:
        if _READS_BY_NAME & set(each.co_names) or _passes_self_on(each):
            return frozenset()  # getattr(self, name), helper(self): any attribute may be read
        other |= {c for c in each.co_consts if isinstance(c, str)}  # getattr(self, "past")
        ins = list(dis.get_instructions(each))
        for i, op in enumerate(ins):
            if op.opname in _ATTRIBUTE_LOADS:
                (recorded if records_into(ins, i) else other).add(op.argval)
    return frozenset(recorded - other)


#: Names by which code may read any attribute of an object: no attribute is only recorded into.
_READS_BY_NAME = frozenset({"__dict__", "vars", "__getattribute__", "getattr", "attrgetter"})


def _passes_self_on(code: Any) -> bool:
    """Whether ``code`` uses ``self`` other than to read or write one of its attributes
    (``helper(self)``, ``return self``): what it is handed to may read any attribute."""
    ins = list(dis.get_instructions(code))
    for i, op in enumerate(ins):
        if op.opname in _SELF_LOADS and op.argval == "self":
            nxt = ins[i + 1].opname if i + 1 < len(ins) else ""
            if nxt not in _ATTRIBUTE_LOADS and nxt != "STORE_ATTR":
                return True
    return False


#: The ops that load a method's ``self`` (a local; a cell in code nested in the method).
_SELF_LOADS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_CHECK"})


#: Methods by which code records into a container it holds (a log of norms, of calls).
RECORDING_METHODS = frozenset(
    {"append", "extend", "appendleft", "add", "insert", "put", "put_nowait"}
)


#: An item set under a key loaded as it is: a constant, a local, a cell, a global.
_ITEM_SETS = [
    [load, "STORE_SUBSCR"] for load in ("LOAD_CONST", "LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL")
]


def records_into(ins: list[Any], i: int) -> bool:
    """Whether the value loaded at ``ins[i]`` is recorded into in place: a recording method
    called on it (``append``, ``extend``, ``add``, ...), an item of it set under a key loaded
    as it is (``x["out"] = v``, the forum's ``activation[name] = v``), or an item of it bumped
    (``x[k] += v``: load, key, ``COPY``, ``COPY``, ``BINARY_SUBSCR``)."""
    after = ins[i + 1 : i + 5]
    if after and after[0].opname in _ATTRIBUTE_LOADS and after[0].argval in RECORDING_METHODS:
        return True
    if [o.opname for o in after[:2]] in _ITEM_SETS:
        return True  # x["out"] = v, x[name] = v: an item set under a key loaded as it is
    return [o.opname for o in after[1:4]] == ["COPY", "COPY", "BINARY_SUBSCR"]


def written_below(cls: type) -> dict[str, frozenset[str]]:
    """For each attribute ``a`` of a module class, the names its forward (and the code it
    reaches: :func:`forward_code`) sets on an object held under it: ``self.a.b = v``,
    ``self.a[0].b = v``, ``self.a.c.b = v`` each name ``b`` under ``a``. Those are the
    forward's own writes (a debug value kept on a monitor object), derived state: left out
    where the object is read by value (:func:`~featbake.encode.identity.held_attribute_text`),
    where the rest of it (``self.a.scale``, set by the user) stays keyed. Kept per class.

    Example:
        >>> class Kept:
        ...     def forward(self, x):
        ...         self.monitor.last = x
        ...         self.stats[0].mean = x
        ...         return x * self.cfg.scale
        >>> written_below(Kept)
        {'monitor': frozenset({'last'}), 'stats': frozenset({'mean'})}
    """
    kept = _WRITTEN_BELOW.get(cls)
    if kept is not None:
        return kept
    found: dict[str, set[str]] = collections.defaultdict(set)
    for code in forward_code(cls):
        ins = list(dis.get_instructions(code))
        for i, op in enumerate(ins):
            if op.opname == "STORE_ATTR":
                top = _held_below_self(ins, i)
                if top is not None:
                    found[top].add(op.argval)
    _WRITTEN_BELOW[cls] = {a: frozenset(names) for a, names in found.items()}
    return _WRITTEN_BELOW[cls]


def _held_below_self(ins: list[Any], store: int) -> str | None:
    """The attribute ``a`` of ``self`` whose held object the ``STORE_ATTR`` at ``ins[store]``
    sets a name on (``self.a.b = v``, through further attributes and constant subscripts),
    None where its object is ``self`` itself or anything else."""
    j, chain = store - 1, []
    while j >= 0:
        op = ins[j]
        if op.opname in _ATTRIBUTE_LOADS:
            chain.append(op.argval)
        elif op.opname == "BINARY_SUBSCR" and j >= 1 and ins[j - 1].opname == "LOAD_CONST":
            j -= 1  # a constant index: self.a[0].b
        elif _loads_self(op):
            return chain[-1] if chain else None
        else:
            return None
        j -= 1
    return None


def _loads_self(op: Any) -> bool:
    """Whether ``op`` loads ``self`` last: one of :data:`_SELF_LOADS`, or 3.13's join of two
    loads (``LOAD_FAST_LOAD_FAST ('out', 'self')`` before ``self.a.b = out``)."""
    if op.opname in _JOINED_SELF_LOADS and isinstance(op.argval, tuple):
        return op.argval[-1] == "self"
    return op.opname in _SELF_LOADS and op.argval == "self"


#: 3.13's loads of two locals at once (the last one loaded is on top).
_JOINED_SELF_LOADS = frozenset({"LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})


#: written_below's, by class (weakly, as _DERIVED).
_WRITTEN_BELOW: weakref.WeakKeyDictionary[type, dict[str, frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def forward_code(cls: type) -> list[Any]:
    """The code a module class's ``forward`` runs of its own: the function (unwrapped), the
    code nested in it and every method of the class it reaches (:func:`reached_code`); none
    where ``forward`` is no plain function."""
    forward = unwrapped(inspect.getattr_static(cls, "forward", None))
    return reached_code(forward.__code__, cls) if inspect.isfunction(forward) else []


def reads_training(cls: type) -> bool:
    """Whether a module class's forward behaves by its mode: its ``forward``, the code nested
    in it and every method of the class it reaches (:func:`reached_code`) read ``training``
    (``Dropout``'s and ``BatchNorm``'s do, ``F.dropout(x, p, self.training)``; ``Linear``'s
    and ``Sequential``'s do not). Kept per class.

    Example:
        >>> import torch
        >>> reads_training(torch.nn.Dropout), reads_training(torch.nn.Linear)
        (True, False)
    """
    kept = _READS_TRAINING.get(cls)
    if kept is not None:
        return kept
    reads = any(
        op.opname in _ATTRIBUTE_LOADS and op.argval == "training"
        for code in forward_code(cls)
        for op in dis.get_instructions(code)
    )
    _READS_TRAINING[cls] = reads
    return reads


#: class -> whether its forward reads ``training``: reads_training's (weakly, as _DERIVED).
_READS_TRAINING: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def fresh_attribute_writes(code: Any) -> set[str]:
    """The attributes ``code`` (a forward, whose arguments are its inputs) writes at least once
    with a value made anew (:func:`fresh_writes`): ``self.pe = pe.to(x.device)`` with ``pe``
    made of the input is one (derived state); ``self.scale = self.scale.to(x.device)`` (the
    value the user set, moved to the input's device) is not, nor is the same through a local,
    a conditional expression or a walrus, so a forward that only moves an attribute keeps it
    keyed.

    Example:
        >>> def forward(self, x):
        ...     self.scale = self.scale.to(x.device)
        ...     s = self.shift
        ...     self.shift = s if x.numel() else 0.0
        ...     self.pe = make(len(x)).to(x.device)
        >>> sorted(fresh_attribute_writes(forward.__code__))
        ['pe']
    """
    return set(fresh_writes([code], None))


#: The ops that read an attribute (``self.x``, ``self.x.to(...)``).
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def inlined_comprehensions(ins: list[Any]) -> dict[int, int]:
    """Python 3.12+ runs a list, set or dict comprehension in the function's own code (PEP
    709): its variables saved (``LOAD_FAST_AND_CLEAR``), its loop, then the variables
    restored (``SWAP`` after the loop's ``END_FOR``, then a store of each). For each such
    comprehension, the index of its last restoring store -> the index of its first
    ``LOAD_FAST_AND_CLEAR``; none before 3.12, whose comprehensions are code of their own.
    One whose value a local takes (``ys = [...]``: the local stored, then the variables, no
    ``SWAP``) is left out: that store ends its statement.

    Example:
        >>> import dis, sys
        >>> def f(self):
        ...     self.m = [m for m in self.m if m]
        >>> spans = inlined_comprehensions(list(dis.get_instructions(f)))
        >>> len(spans) == (sys.version_info >= (3, 12))
        True
    """
    spans: dict[int, int] = {}
    opened: list[tuple[int, list[str]]] = []  # (first LOAD_FAST_AND_CLEAR, the variables)
    for i, op in enumerate(ins):
        if op.opname == "LOAD_FAST_AND_CLEAR":
            if opened and opened[-1][0] + len(opened[-1][1]) == i:
                opened[-1][1].append(op.argval)
            else:
                opened.append((i, [op.argval]))
        elif (
            op.opname == "SWAP"
            and opened
            and _stored(ins, i + 1)[:1] == opened[-1][1][-1:]
            and "END_FOR" in [o.opname for o in ins[max(i - 2, 0) : i]]  # not a handler's
        ):
            start, names = opened.pop()
            end, restored = i, 0
            while restored < len(names) and _stored(ins, end + 1):
                end += 1
                restored += len(_stored(ins, end))
            spans[end] = start
    return spans


def _stored(ins: list[Any], i: int) -> list[str]:
    """The locals the op at ``ins[i]`` stores (3.13 joins two stores in one op), in order."""
    if i >= len(ins) or ins[i].opname not in _LOCAL_STORES:
        return []
    names = ins[i].argval
    if ins[i].opname == "STORE_FAST_LOAD_FAST":
        return [names[0]]
    return list(names) if isinstance(names, tuple) else [names]


#: The ops that store locals (3.13 joins a store with a load or another store).
_LOCAL_STORES = frozenset({"STORE_FAST", "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST"})


# == what a write is made of =======================================================================
# A write to ``self.x`` in a forward is derived state (neither keyed nor watched) only where the
# value stored is made of nothing the key would otherwise read of ``x``: not of ``x`` as it was
# (``y = self.x; self.x = y.to(d)``, ``self.x = self.x if c else d``, a walrus, a method that
# returns it, ``getattr(self, "x")``, an in-place ``copy_`` into a local), nor of what no reading
# follows (an argument from no caller seen, code whose bytecode is not read). The code is read as
# data flow: each value on the stack, in a local, a closure cell, an attribute of self, an
# argument and a return carries the set of what it may be made of (tokens), joined where
# branches meet; what a call or a store into an object may change (a local's tensor, a list)
# takes the call's inputs too. Control flow (``if self.pe is None``) carries nothing: a lazy
# table stays derived.

#: Tokens: ``self`` itself (any attribute may be read through it), and what no reading follows.
_SELF = ("self",)
_UNKNOWN = ("unknown",)
#: A callee mark: the value is ``super()`` (its attributes are the next class's).
_SUPER = ("super",)
#: A callee mark: calling the value runs code no reading follows (a class of the user's, a
#: function of the user's past :data:`_FOLLOW_DEPTH`): its result is anything.
_OPAQUE = ("opaque",)


class _Slot(NamedTuple):
    """What one value may be made of (``made``), which objects it may be (``alias``: a local,
    a cell, an attribute of self; a change to it changes those) and what calling it runs
    (``callee``: code keys)."""

    made: frozenset[Any]
    alias: frozenset[Any]
    callee: frozenset[Any]
    known: _Known | None = None  # a global's value, or an attribute's of a module or class


class _Known:
    """A value code loads as a global, read as it is now (compared by identity: a tensor's
    ``==`` is no truth value)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


_EMPTY = _Slot(frozenset(), frozenset(), frozenset())
#: A path's mark that an attribute may still hold its value from before the run (a local of
#: its own, by name): cleared by a write on the path, kept where any path joining keeps it.
_OLD = _Slot(frozenset({("old",)}), frozenset(), frozenset())
_OLD_MARK = "#old:"
#: A path's mark that it has passed a condition reading an attribute (by name), kept where
#: any path joining has passed one.
_GUARD_MARK = "#guard:"
#: The same mark for a condition on a method's result (the attributes it reads, known at the
#: end: :attr:`_Facts.guard_callees`).
_GUARD_RET_MARK = "#guard-ret:"


def _guard_marks(names: Mapping[str, Any]) -> frozenset[str]:
    """The conditions a path's locals say it has passed (:data:`_GUARD_MARK`,
    :data:`_GUARD_RET_MARK`)."""
    return frozenset(k for k in names if k.startswith((_GUARD_MARK, _GUARD_RET_MARK)))


#: The token of the forward's inputs (its arguments): what a lazy table's guard compares the
#: table with (``self.pe.size(0) < x.size(1)``).
_INPUT = ("input",)
#: Tokens a condition may compare an attribute with that make it a lazy table's guard: the
#: inputs, an argument, a method's or function's result, a cell, another attribute.
_COMPARED = frozenset({"input", "param", "ret", "cell", "attr"})


def _compared(made: Iterable[Any], name: str) -> bool:
    """Whether a condition made of ``made`` reads attribute ``name`` together with something
    else that may change from run to run (:data:`_COMPARED`): a lazy table's guard
    (``self.pe.size(0) < x.size(1)``). One reading it against constants and globals only
    (``self.scale is None``) is a default's: the user's value it keeps is a setting. A private
    attribute (bookkeeping, never keyed: :func:`keyed_attribute`) is guarded by any condition
    reading it, as before (``if not self._hf_peft_config_loaded``)."""
    if not keyed_attribute(name):
        return True
    return any(t[0] in _COMPARED and t != ("attr", name) for t in made)


_RAISED = _Slot(frozenset({_UNKNOWN}), frozenset(), frozenset())
_SELF_SLOT = _Slot(frozenset({_SELF}), frozenset({_SELF}), frozenset())


def _joined(slots: Iterable[_Slot]) -> _Slot:
    made: set[Any] = set()
    alias: set[Any] = set()
    callee: set[Any] = set()
    for s in slots:
        made |= s.made
        alias |= s.alias
        callee |= s.callee
    return _Slot(frozenset(made), frozenset(alias), frozenset(callee))


#: Callee marks of a value an attribute of self holds (not a method of the class's): the
#: attribute itself (``self.reader``), or a value reached from it (``self.helper.current``,
#: ``self.fns[0]``). Calling one may run anything the instance holds (:func:`module_derived`).
_HELD = ("held", "via")


def _via(callee: Iterable[Any]) -> frozenset[Any]:
    """The held marks of a value reached from one (:data:`_HELD`)."""
    return frozenset(("via", c[1]) for c in callee if c[0] in _HELD)


def _codes(callee: Iterable[Any]) -> list[Any]:
    """The code keys among callee marks (no ``super()``, opaque or held mark)."""
    return [c for c in callee if c[0] == "code"]


def _key(code: Any) -> tuple[str, int]:
    """A code object's key in :class:`_Facts` (the objects are held there)."""
    return ("code", id(code))


@dataclasses.dataclass
class _Facts:
    """What the code of one class makes of its values, each table a join over the code read:
    the writes to self's attributes (by code key, place in the source and name), what each
    attribute of self is given (stored or changed in place), each code's returns, the inputs
    of its calls (its arguments), each closure cell's and global's values; the code read by
    key, the code whose arguments are the forward's inputs, the code still to read."""

    cls: type | None
    selfs: frozenset[str]
    writes: dict[tuple[Any, Any, str], set[Any]] = dataclasses.field(default_factory=dict)
    stored: dict[str, set[Any]] = dataclasses.field(default_factory=dict)
    returns: dict[Any, set[Any]] = dataclasses.field(default_factory=dict)
    calls: dict[Any, set[Any]] = dataclasses.field(default_factory=dict)
    cells: dict[str, set[Any]] = dataclasses.field(default_factory=dict)
    globals: dict[str, set[Any]] = dataclasses.field(default_factory=dict)
    codes: dict[Any, Any] = dataclasses.field(default_factory=dict)
    clean: set[Any] = dataclasses.field(default_factory=set)
    pending: list[Any] = dataclasses.field(default_factory=list)
    scopes: dict[Any, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    depth: dict[Any, int] = dataclasses.field(default_factory=dict)
    read_old: set[str] = dataclasses.field(default_factory=set)
    guarded: dict[Any, set[str]] = dataclasses.field(default_factory=dict)
    guarded_calls: set[tuple[Any, Any, frozenset[str]]] = dataclasses.field(default_factory=set)
    closures: dict[Any, dict[str, Any]] = dataclasses.field(default_factory=dict)
    guard_callees: dict[Any, str] = dataclasses.field(default_factory=dict)
    attr_reads: dict[Any, set[str]] = dataclasses.field(default_factory=dict)
    exit_old: dict[Any, set[str]] = dataclasses.field(default_factory=dict)
    written: dict[Any, frozenset[str]] = dataclasses.field(default_factory=dict)

    def add(self, table: dict[Any, set[Any]], key: Any, tokens: Iterable[Any]) -> None:
        table.setdefault(key, set()).update(tokens)

    def follow(self, func: Any, caller: Any) -> Any:
        """The code key of a function of the user's called outside the class (``caller``: the
        code calling it), queued to be read with its globals; ``_OPAQUE`` past
        :data:`_FOLLOW_DEPTH` calls from the class's code."""
        key = _key(func.__code__)
        depth = self.depth.get(caller, 0) + 1
        if key in self.codes or any(key == _key(c) for c in self.pending):
            return key
        if depth > _FOLLOW_DEPTH:
            return _OPAQUE
        self.depth[key] = depth
        self.pending.append(func.__code__)
        _scope(func, self.scopes)
        if func.__closure__:  # its cells as they are (a hand-written decorator's ``fn``)
            self.closures[key] = dict(zip(func.__code__.co_freevars, func.__closure__, strict=True))
        return key

    def method(self, name: str, after: Any = None) -> tuple[Any, bool] | None:
        """What reading attribute ``name`` of self runs: ``(code key, whether it is a
        property's getter)``, or None where it is no function of the class (a setting, a
        submodule). ``after``: the code reading it through ``super()`` (the classes after the
        one defining that code, in the MRO, are searched)."""
        if self.cls is None:
            return None
        classes = list(self.cls.__mro__)
        if after is not None:
            owner = [i for i, k in enumerate(classes) if _defines(k, after)]
            classes = classes[owner[0] + 1 :] if owner else classes
        for k in classes:
            found = vars(k).get(name)
            if found is None:
                continue
            func = method_function(found)
            if not inspect.isfunction(func):
                return None
            if _key(func.__code__) not in self.codes:
                self.pending.append(func.__code__)
                _scope(func, self.scopes)
            getter = isinstance(found, property) or type(found).__name__ == "cached_property"
            return _key(func.__code__), getter
        return None


def _defines(klass: type, code: Any) -> bool:
    """Whether ``klass`` defines a function (method, property) whose code is ``code``."""
    return any(getattr(method_function(v), "__code__", None) is code for v in vars(klass).values())


def fresh_writes(codes: list[Any], cls: type | None) -> frozenset[str]:
    """The attributes of self that ``codes`` (a class's forward first, and the code it
    reaches: :func:`forward_code`) write at least once with a value made anew: of nothing
    but the forward's inputs, constants, globals and other attributes (see above), and whose
    value from before the run no path uses (read where the path has not written it), unless
    a condition reads the attribute (a lazy table's ``if self.pe is None``). The forward's
    arguments are its inputs; another method's are what its calls pass; a nested function's,
    what the code calling it passes; a function of the user's outside the class (``cls``
    given: the class's own code is read with its globals), what its callers pass.

    A call of a callable an attribute of self holds (``self.conv(x)``, ``self.reader()``) is
    taken as a submodule's, made of its inputs: the class does not say what an instance
    holds there (:func:`module_derived` reads it)."""
    return _fresh_reading(codes, cls)[0]


def _fresh_reading(
    codes: list[Any], cls: type | None
) -> tuple[frozenset[str], dict[str, frozenset[Any]]]:
    """:func:`fresh_writes`' answer, taking a call of a callable an attribute of self holds as
    made of its inputs (a submodule's), and for each attribute in it the callables of self's
    attributes its writes are made of calling: ``("called", name)`` (``self.reader()``) or
    ``("called-via", name)`` (``self.helper.current()``, ``self.fns[0](x)``)."""
    written: dict[Any, frozenset[str]] = {}
    for _ in range(_WRITE_ROUNDS):
        facts = _read_codes(codes, cls, written)
        own = {_key(c) for c in codes}
        fresh = {
            name
            for (key, _, name), made in facts.writes.items()
            if key in own and not _reaches(made, name, facts)
        }
        # one whose value from before the run may be used (read where the path has not
        # written it) is the forward's own only where a write of it made anew is on a path
        # past a condition reading it (a lazy table's ``if self.pe is None``)
        old = fresh & facts.read_old - _guarded_fresh(facts, own)
        if not old or facts.written == written:
            break
        written = facts.written  # the methods' writes known now: read again with them
    result = fresh - old
    called: dict[str, set[Any]] = {}
    for (key, _, name), made in facts.writes.items():
        if key in own and name in result:
            found = _called_in(made, facts)
            if found:
                called.setdefault(name, set()).update(found)
    return frozenset(result), {name: frozenset(ts) for name, ts in called.items()}


def _guarded_fresh(facts: _Facts, own: set[Any]) -> set[str]:
    """The attributes a write of which (in ``own`` code; made anew or not) is on a path past
    a condition reading the attribute (or calling a method of the class's that reads it:
    ``if self._weights_have_changed()``): in its code, or in code called on such a path (a
    method the forward calls under ``if seq_len > self.cached_len``), to any depth. A
    condition elsewhere (``if self.scale != 1``) guards no write of it."""
    callees = {mark: callee for callee, mark in facts.guard_callees.items()}

    def read(marks: Iterable[str]) -> set[str]:
        out = set()
        for mark in marks:
            if mark in callees:  # what it reads together with something else
                reads = facts.attr_reads.get(callees[mark], set())
                ret = facts.returns.get(callees[mark], set())
                out |= {a for a in reads if reads - {a} or _compared(ret, a)}
            else:
                out.add(mark[len(_GUARD_MARK) :])
        return out

    within: dict[Any, set[str]] = {}
    grew = True
    while grew:
        grew = False
        for caller, callee, marks in facts.guarded_calls:
            new = read(marks) | within.get(caller, set())
            if not new <= within.setdefault(callee, set()):
                within[callee] |= new
                grew = True
    return {
        name
        for key, where, name in facts.writes
        if key in own
        and (name in read(facts.guarded.get((key, where, name), ())) or name in within.get(key, ()))
    }


#: How many times a class's code is read, each with what the methods it calls write on every
#: path (a forward calling a method that writes what it reads next), before the answer stands.
_WRITE_ROUNDS = 3


def _read_codes(codes: list[Any], cls: type | None, written: dict[Any, frozenset[str]]) -> _Facts:
    """One reading of ``codes`` (:func:`fresh_writes`), ``written`` what each method writes on
    every path that returns (from the reading before)."""
    selfs = {"self"} | {c.co_varnames[0] for c in codes if c.co_argcount and _method_code(c)}
    facts = _Facts(cls, frozenset(selfs), clean={_key(codes[0])} if codes else set())
    facts.pending = list(codes)
    for klass in cls.__mro__ if cls is not None else ():
        for attr in vars(klass).values():
            func = method_function(attr)
            if inspect.isfunction(func):
                _scope(func, facts.scopes)
    while facts.pending:
        code = facts.pending.pop()
        if _key(code) in facts.codes:
            continue
        facts.codes[_key(code)] = code
        nested = [c for c in code.co_consts if inspect.iscode(c)]
        facts.pending += nested
        for c in nested:
            if _key(code) in facts.depth:
                facts.depth.setdefault(_key(c), facts.depth[_key(code)])
        reading = _Interpreter(code, facts, written)
        if not reading.run():
            _unread(code, facts)
        elif _key(code) in facts.exit_old and _writes_when_called(code, facts):
            facts.written[_key(code)] = reading.stores - frozenset(facts.exit_old[_key(code)])
    return facts


#: Code whose body a call does not run (a generator's, a coroutine's: run when iterated).
_DEFERRED = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _writes_when_called(code: Any, facts: _Facts) -> bool:
    """Whether what ``code`` writes on every path counts as written where it is called: a
    method of the class's whose body a call runs. A function outside the class (followed:
    its ``self`` may be any object passed) and a generator (its body runs when iterated,
    maybe never) do not count."""
    return _key(code) not in facts.depth and not code.co_flags & _DEFERRED


def argument_names(code: Any) -> tuple[str, ...]:
    """The names of a code object's arguments, in order (keyword-only, ``*args`` and
    ``**kwargs`` too).

    Example:
        >>> argument_names((lambda a, *b, c, **d: None).__code__)
        ('a', 'c', 'b', 'd')
    """
    count = code.co_argcount + code.co_kwonlyargcount
    count += bool(code.co_flags & inspect.CO_VARARGS) + bool(code.co_flags & inspect.CO_VARKEYWORDS)
    return tuple(code.co_varnames[:count])


def _method_code(code: Any) -> bool:
    """Whether ``code`` is a function's own (no nested function's, lambda's, comprehension's)."""
    return "<locals>" not in getattr(code, "co_qualname", "<locals>") and code.co_name != "<lambda>"


def _unread(code: Any, facts: _Facts) -> None:
    """What code whose bytecode could not be read may do: return, store into any attribute
    and cell it names, and pass to any code it may call, what no reading follows."""
    unknown = {_UNKNOWN}
    facts.add(facts.returns, _key(code), unknown)
    for name in code.co_names:
        facts.add(facts.stored, name, unknown)
        found = facts.method(name)
        if found is not None:
            facts.add(facts.calls, found[0], unknown)
    for name in (*code.co_cellvars, *code.co_freevars):
        facts.add(facts.cells, name, unknown)
    for nested in code.co_consts:
        if inspect.iscode(nested):
            facts.add(facts.calls, _key(nested), unknown)


def _tokens_from(made: Iterable[Any], facts: _Facts) -> Iterator[Any]:
    """Every token a value made of ``made`` may be made of, each once, ``made``'s own first:
    followed through what each attribute, return, argument and cell was given
    (:func:`_made_of`); lazily, so a search stops where it finds what it looks for."""
    todo = list(made)
    seen: set[Any] = set()
    while todo:
        token = todo.pop()
        if token in seen:
            continue
        seen.add(token)
        yield token
        todo += _made_of(token, facts)


def _reaches(made: Iterable[Any], name: str, facts: _Facts) -> bool:
    """Whether a value made of ``made`` may carry attribute ``name`` of self as it was, or
    what no reading follows (:func:`_tokens_from`)."""
    return any(t in (_SELF, _UNKNOWN) or t == ("attr", name) for t in _tokens_from(made, facts))


def _made_of(token: Any, facts: _Facts) -> Iterable[Any]:
    """What the value a token names may be made of: what an attribute, a cell or a global
    was given, what a code returns, what its calls pass (anything where none is seen)."""
    kind = token[0]
    if kind == "attr":
        return facts.stored.get(token[1], ())
    if kind == "ret":
        return facts.returns.get(token[1], ())
    if kind == "param":
        return facts.calls.get(token[1], {_UNKNOWN})
    if kind == "cell":
        return facts.cells.get(token[1], ())
    if kind == "global":
        return facts.globals.get(token[1], ())
    return ()


def _called_in(made: Iterable[Any], facts: _Facts) -> set[Any]:
    """The calls of callables self's attributes hold that a value made of ``made`` may be
    made of (``("called", name)``, ``("called-via", name)``; :func:`_tokens_from`)."""
    return {t for t in _tokens_from(made, facts) if t[0] in ("called", "called-via")}


# == what code outside the class reads =============================================================
# The user's own code (no library's: :func:`is_library_code`) is read with its globals: a global
# of the user's function is followed into (its returns, what it is given), a module's or class's
# attribute is read as it is now, and a value that may hold the module (:func:`_holds`: the
# module itself, an object or container holding it, a bound method of it, a function whose
# closure or defaults hold it, a module or class of the user's used as a value) is anything.
# Library code keeps the rule for calls: a result is made of the inputs.

#: How many calls deep a reading follows functions of the user's outside the class.
_FOLLOW_DEPTH = 4
#: How deep and how many items of a container :func:`_holds` reads before taking it as holding.
_HOLD_DEPTH = 3
_HOLD_ITEMS = 64
#: Values that hold nothing: plain values, and what a tensor library makes of its own.
_INERT = (bool, int, float, complex, str, bytes, type(Ellipsis), range, slice)


def _scope(func: Any, scopes: dict[Any, Mapping[str, Any]]) -> None:
    """Read ``func`` (a function of the user's own code) and the code nested in it with its
    globals; library code keeps none (its globals are library code, as before)."""
    if is_library_code(func):
        return
    todo = [func.__code__]
    while todo:
        code = todo.pop()
        if _key(code) not in scopes:
            scopes[_key(code)] = func.__globals__
            todo += [c for c in code.co_consts if inspect.iscode(c)]


def is_library_code(obj: Any) -> bool:
    """Whether a function, class or module is library code: of torch, featbake, the standard
    library or builtins by its top module, or from a file under the standard library's or
    installed packages' folders."""
    name = getattr(obj, "__name__", "") if inspect.ismodule(obj) else getattr(obj, "__module__", "")
    top = (name or "").partition(".")[0]
    if top in ("torch", "featbake", "builtins", "numpy") or top in sys.stdlib_module_names:
        return True
    if inspect.ismodule(obj):
        filename = getattr(obj, "__file__", None) or ""
    elif inspect.isfunction(obj):
        filename = obj.__code__.co_filename
    else:
        filename = getattr(sys.modules.get(name or ""), "__file__", None) or ""
    return bool(filename) and _under_installed(filename)


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(os.path.realpath(paths[n]) + os.sep for n in names if n in paths)


@functools.lru_cache(maxsize=1024)
def _under_installed(filename: str) -> bool:
    return not filename.startswith("<") and os.path.realpath(filename).startswith(
        _installed_roots()
    )


def _holds(value: Any, depth: int = 0) -> bool:
    """Whether ``value``, read as code outside the class reads it, may hold or be the module
    (see above). None may be set to it later; a container past :data:`_HOLD_DEPTH` levels or
    :data:`_HOLD_ITEMS` items, and any object not named here, may."""
    if isinstance(value, (*_INERT, enum.Enum)):
        return False
    if inspect.ismodule(value) or isinstance(value, type):
        return not is_library_code(value)
    if _tensor_like(value):
        return False
    if depth >= _HOLD_DEPTH:
        return True
    if isinstance(value, (types.BuiltinFunctionType, types.MethodWrapperType)):
        owner = getattr(value, "__self__", None)
        return owner is not None and not inspect.ismodule(owner) and _holds(owner, depth + 1)
    if inspect.ismethod(value):
        return _holds(value.__self__, depth + 1) or _holds(value.__func__, depth + 1)
    if inspect.isfunction(value):
        return not is_library_code(value) and _function_holds(value, depth)
    if isinstance(value, functools.partial):
        held = [value.func, *value.args, *value.keywords.values()]
        return any(_holds(v, depth + 1) for v in held)
    if type(value) in (list, tuple, set, frozenset, dict):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else list(value)
        return len(items) > _HOLD_ITEMS or any(_holds(v, depth + 1) for v in items)
    return True


def _function_holds(func: Any, depth: int) -> bool:
    """Whether a function of the user's holds the module in a closure cell or a default; a
    function of the user's as a default (``get=lambda: ENC.scale``) is run by code no reading
    follows, so it may (one in a closure cell, a hand-written decorator's ``fn``, is followed
    where the function is called: :meth:`_Interpreter._cell`)."""
    held = [*(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values()]
    cells = []
    for cell in func.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell: filled later, with anything
            return True
    return any(_held_function(v) or _holds(v, depth + 1) for v in held) or any(
        _holds(v, depth + 1) for v in cells
    )


def _held_function(value: Any) -> bool:
    """Whether ``value`` is a function of the user's (a partial's or a method's too)."""
    func = method_function(value.func if isinstance(value, functools.partial) else value)
    return inspect.isfunction(func) and not is_library_code(func)


def _tensor_like(value: Any) -> bool:
    """A tensor, array, dtype or device (no module): values that hold no module."""
    owner = type(value).__module__.partition(".")[0]
    if owner not in ("torch", "numpy"):
        return False
    import torch  # loaded already: its value is here

    return not isinstance(value, torch.nn.Module)


#: Ops that move nothing on the stack as read here (3.11's PRECALL and KW_NAMES among them).
_STILL = frozenset(
    {"NOP", "RESUME", "PRECALL", "KW_NAMES", "CACHE", "EXTENDED_ARG", "MAKE_CELL",
     "COPY_FREE_VARS", "NOT_TAKEN", "RESUME_CHECK", "INSTRUMENTED_LINE"}
)  # fmt: skip
#: Jumps that always jump, and ops after which the code goes on nowhere.
_ALWAYS_JUMPS = frozenset(
    {"JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP", "JUMP_NO_INTERRUPT",
     "JUMP_ABSOLUTE"}
)  # fmt: skip
_ENDS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"})
#: Ops that only pop.
_POPS = frozenset(
    {"POP_TOP", "END_FOR", "POP_ITER", "POP_EXCEPT", "STORE_GLOBAL", "STORE_NAME",
     "DELETE_ATTR", "DELETE_SUBSCR", "POP_BLOCK"}
)  # fmt: skip
#: Ops that push values made of nothing on the stack (a constant, a global, a NULL).
_PUSHES = frozenset(
    {"LOAD_CONST", "LOAD_SMALL_INT", "PUSH_NULL", "LOAD_GLOBAL", "LOAD_NAME",
     "LOAD_BUILD_CLASS", "LOAD_ASSERTION_ERROR", "LOAD_COMMON_CONSTANT", "RETURN_GENERATOR"}
)  # fmt: skip
#: Ops that put what they pop into the container below (``[... for ...]``, ``{**a}``).
_INTO = frozenset(
    {"LIST_APPEND", "SET_ADD", "MAP_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE",
     "DICT_MERGE"}
)  # fmt: skip
#: Ops that make a value of what they pop and change none of it.
_PURE = frozenset(
    {"BINARY_SUBSCR", "BINARY_SLICE", "COMPARE_OP", "IS_OP", "CONTAINS_OP", "UNARY_NEGATIVE",
     "UNARY_NOT", "UNARY_INVERT", "UNARY_POSITIVE", "BUILD_TUPLE", "BUILD_LIST", "BUILD_SET",
     "BUILD_MAP", "BUILD_CONST_KEY_MAP", "BUILD_STRING", "BUILD_SLICE", "FORMAT_VALUE",
     "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE", "TO_BOOL", "GET_ITER", "GET_LEN",
     "LIST_TO_TUPLE", "UNPACK_SEQUENCE", "UNPACK_EX", "FOR_ITER", "PUSH_EXC_INFO",
     "CHECK_EXC_MATCH", "WITH_EXCEPT_START", "MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"}
)  # fmt: skip
#: Methods by which code changes a container a global holds (``CACHE.update(...)``); a global's
#: other attributes (``torch.zeros``) change nothing of it as read here.
_CHANGING_METHODS = RECORDING_METHODS | {"update", "setdefault", "__setitem__", "copy_", "set_"}
#: Past this many steps a code's reading gives up (as code not read).
_MAX_STEPS = 20000

_State = tuple[tuple[_Slot, ...], dict[str, _Slot]]


class _Interpreter:
    """One code object read as data flow into :class:`_Facts` (see above)."""

    def __init__(
        self, code: Any, facts: _Facts, written: Mapping[Any, frozenset[str]] | None = None
    ) -> None:
        self.code = code
        self.written = written or {}
        self.facts = facts
        self.key = _key(code)
        self.ins = list(dis.get_instructions(code))
        self.at = {op.offset: i for i, op in enumerate(self.ins)}
        self.handler: dict[int, tuple[int, int, bool]] = {}
        self.changed = True  # whether the last op changed a local (the handlers see it)
        self.scope = facts.scopes.get(self.key)  # its globals, where it is the user's code
        self.stores = frozenset(str(op.argval) for op in self.ins if op.opname == "STORE_ATTR")
        self.known: dict[int, _Known] = {}
        entries: Any = getattr(dis.Bytecode(code), "exception_entries", [])  # 3.11+: typed later
        for e in entries:
            for i, op in enumerate(self.ins):
                if e.start <= op.offset < e.end and e.target in self.at:
                    self.handler.setdefault(i, (self.at[e.target], e.depth, e.lasti))

    def run(self) -> bool:
        """Read the code to a fixed point, a block at a time (from each jump target, in the
        code's order): states are kept and joined only where blocks begin; False where the
        code cannot be read."""
        n = len(self.ins)
        starts = [op.is_jump_target for op in self.ins] + [True]
        states: dict[int, _State] = {0: ((), self._arguments())}
        todo, queued, steps = [0], {0}, 0
        while todo:
            b = heapq.heappop(todo)
            queued.discard(b)
            stack, names = list(states[b][0]), dict(states[b][1])
            i, raised_at = b, None
            while True:
                steps += 1
                if steps > _MAX_STEPS or i >= n:
                    return False
                if i in self.handler and (self.changed or raised_at != self.handler[i]):
                    target, depth, lasti = raised_at = self.handler[i]
                    if depth > len(stack):
                        return False
                    raised = (*stack[:depth], *[_EMPTY] * lasti, _RAISED)  # any value
                    if not self._reach(states, target, raised, dict(names), todo, queued):
                        return False
                self.changed = False
                try:
                    nexts = self._step(self.ins[i], stack, names)
                except (IndexError, KeyError, TypeError, ValueError):
                    return False
                if len(nexts) == 1 and nexts[0][0] == i + 1 and not starts[i + 1]:
                    i += 1
                    continue
                for j, new_stack, new_names in nexts:
                    if not self._reach(states, j, tuple(new_stack), new_names, todo, queued):
                        return False
                break
        return True

    def _reach(
        self,
        states: dict[int, _State],
        j: int,
        stack: tuple[_Slot, ...],
        names: dict[str, _Slot],
        todo: list[int],
        queued: set[int],
    ) -> bool:
        """Join a state into the one where block ``j`` begins, queueing the block where it
        grew; False where the two cannot be joined."""
        old = states.get(j)
        merged = _merge(old, (stack, names))
        if merged is None:
            return False
        if merged is not old:
            states[j] = merged
            if j not in queued:
                heapq.heappush(todo, j)
                queued.add(j)
        return True

    def _arguments(self) -> dict[str, _Slot]:
        """The locals at the start: self, and each argument (the inputs where clean)."""
        code = self.code
        given = (
            _Slot(frozenset({_INPUT}), frozenset(), frozenset())
            if self.key in self.facts.clean
            else _Slot(frozenset({("param", self.key)}), frozenset(), frozenset())
        )
        names = {_OLD_MARK + name: _OLD for name in self.stores}
        for name in argument_names(code):
            slot = _SELF_SLOT if name in self.facts.selfs else given
            names[name] = slot
            if name in code.co_cellvars:
                self.facts.add(self.facts.cells, name, slot.made)
        return names

    def _step(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> list[Any]:
        """The states after ``op``: ``(index, stack, locals)`` of each op that may run next."""
        if op.opname in ("RETURN_VALUE", "YIELD_VALUE"):
            self.facts.add(self.facts.returns, self.key, stack[-1].made)
        if op.opname in ("RETURN_VALUE", "RETURN_CONST"):  # what this path has not written
            old = {
                k[len(_OLD_MARK) :] for k, v in names.items() if k.startswith(_OLD_MARK) and v.made
            }
            self.facts.add(self.facts.exit_old, self.key, old)
        if op.opname in _ENDS:
            return []
        if op.opcode in dis.hasjrel or op.opcode in dis.hasjabs:
            return self._jump(op, stack, names)
        self._move(op, stack, names)
        return [(self.at[op.offset] + 1, stack, names)]

    def _move(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """What ``op`` (no jump) does to the stack and the locals."""
        name = op.opname
        if name in _STILL:
            pass
        elif name.startswith(("LOAD_FAST", "STORE_FAST", "DELETE_FAST")):
            self._local(op, stack, names)
        elif name.endswith("DEREF") or name in ("LOAD_CLOSURE", "LOAD_CLASSDEREF"):
            self._cell(op, stack)
        elif name in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
            self._attribute(op, stack, names)
        elif name in ("STORE_ATTR", "STORE_SUBSCR", "STORE_SLICE"):
            self._store(op, stack, names)
        elif name.startswith("CALL") or name == "BEFORE_WITH":
            self._call(op, stack, names)
        elif name == "COPY":
            stack.append(stack[-op.arg])
        elif name == "SWAP":
            stack[-1], stack[-op.arg] = stack[-op.arg], stack[-1]
        else:
            self._other(op, stack, names)

    def _effect(self, op: Any, jump: bool = False) -> int:
        arg = op.arg if op.opcode >= dis.HAVE_ARGUMENT else None
        return dis.stack_effect(op.opcode, arg, jump=jump)

    def _jump(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> list[Any]:
        """A jump: where it goes (``op.argval``) and, unless it always jumps, the next op, each
        with the stack its path leaves (a condition popped, ``x or y`` kept, an iterator's
        next item pushed as the iterator it comes of)."""
        target = self.at[op.argval]
        if "IF" in op.opname and stack:  # a condition: the attributes it reads guard writes
            made = stack[-1].made
            marks = {_GUARD_MARK + t[1] for t in made if t[0] == "attr" and _compared(made, t[1])}
            for t in made:  # a method's result: the attributes it reads (read at the end)
                if t[0] == "ret":
                    mark = f"{_GUARD_RET_MARK}{t[1]!r}"
                    marks.add(self.facts.guard_callees.setdefault(t[1], mark))
            if any(m not in names for m in marks):
                names = {**names, **{m: _OLD for m in marks}}
        out = []
        for jump in (True, False):
            if not jump and op.opname in _ALWAYS_JUMPS:
                continue
            now = list(stack)
            effect = self._effect(op, jump)
            if effect < 0:
                del now[len(now) + effect :]
            elif effect > 0:
                now += [now[-1] if now else _EMPTY] * effect
            out.append((target if jump else self.at[op.offset] + 1, now, names))
        return out

    def _local(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """A local loaded (self as :data:`_SELF_SLOT`; a value with the local among what it
        may be), stored, deleted or cleared (3.12's comprehensions); 3.13's joined ops too."""
        name = op.opname
        args = op.argval if isinstance(op.argval, tuple) else (op.argval,)
        if name.startswith("LOAD_FAST"):
            for a in args:
                stack.append(self._load(a, names))
            if name == "LOAD_FAST_AND_CLEAR":
                names[args[0]] = _EMPTY
                self.changed = True
        elif name == "STORE_FAST_LOAD_FAST":
            self.changed = True
            names[args[0]] = stack.pop()
            stack.append(self._load(args[1], names))
        elif name.startswith("STORE_FAST"):
            self.changed = True
            for a in args:
                names[a] = stack.pop()
        else:
            self.changed = True
            names[args[0]] = _EMPTY

    def _load(self, local: str, names: dict[str, _Slot]) -> _Slot:
        if local in self.facts.selfs:
            return _SELF_SLOT
        slot = names.get(local, _EMPTY)
        return slot._replace(alias=slot.alias | {("local", local)})

    def _cell(self, op: Any, stack: list[_Slot]) -> None:
        """A closure cell loaded or stored, read by name across the class's code."""
        cell = op.argval
        if op.opname.startswith("LOAD") or op.opname == "LOAD_CLOSURE":
            if op.opname == "LOAD_FROM_DICT_OR_DEREF":
                stack.pop()
            held = self.facts.closures.get(self.key, {}).get(cell)
            if cell in self.facts.selfs:
                stack.append(_SELF_SLOT)
            elif held is not None and op.opname == "LOAD_DEREF":  # a followed function's
                token = frozenset({("cell", cell)})
                try:
                    value = held.cell_contents
                except ValueError:  # empty: filled later, with anything
                    value = _MISSING
                stack.append(self._valued(token, token, value))
            else:
                token = frozenset({("cell", cell)})
                stack.append(_Slot(token, token, frozenset()))
        elif op.opname == "STORE_DEREF":
            self.facts.add(self.facts.cells, cell, stack.pop().made)

    def _attribute(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """An attribute read. Of self: its token (a setting, state), or for a method the code
        it runs (its returns come with its calls; a property's with the read); an attribute
        that reads any by name (``__dict__``) is self. Of another value: the value's tokens."""
        popped = 3 if op.opname == "LOAD_SUPER_ATTR" else 1
        pushed = popped + self._effect(op)
        owner = _joined(stack[len(stack) - popped :])
        del stack[len(stack) - popped :]
        through_super = op.opname == "LOAD_SUPER_ATTR" or _SUPER in owner.callee
        name = str(op.argval)
        if _SELF not in owner.alias and not through_super:
            alias = frozenset(a for a in owner.alias if a[0] != "global")
            if name in _CHANGING_METHODS:  # CACHE.update(...): a change to the global
                alias |= {("changed", a[1]) for a in owner.alias if a[0] == "global"}
            slot = _Slot(owner.made, alias, _via(owner.callee))
            if owner.known is not None and _namespace(owner.known.value):
                found = _static_attribute(owner.known.value, name)
                slot = self._valued(owner.made - {_UNKNOWN}, alias, found)
            stack += [slot] * pushed
            return
        rest = owner.made - {_SELF}
        if name in _READS_BY_NAME or name.startswith("__"):
            rest |= {_SELF}
        found = self.facts.method(name, self.code if through_super else None)
        if found is None:
            self.facts.add(self.facts.attr_reads, self.key, (name,))
            if names.get(_OLD_MARK + name, _OLD).made:  # not written on this path yet
                self.facts.read_old.add(name)
            token = frozenset({("attr", name)})
            slot = _Slot(rest | token, token, frozenset({("held", name)}))  # if called
        elif found[1]:  # a property: its getter runs now
            slot = _Slot(rest | {("ret", found[0])}, frozenset(), frozenset())
        else:
            slot = _Slot(rest, frozenset(), frozenset({found[0]}))
        stack += [slot] * pushed

    def _store(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """A store into an attribute (of self: a write, what the attribute is given), an item
        or a slice: what the value is made of goes into what the target may be."""
        if op.opname == "STORE_ATTR":
            owner, value = stack.pop(), stack.pop()
            if _SELF in owner.alias:
                # by where it is in the source: 3.12 copies a statement into each branch
                # that ends in it (``self.x = a if c else b``), 3.11 a ``finally`` block
                write = (self.key, getattr(op, "positions", None) or op.offset, str(op.argval))
                self.facts.add(self.facts.writes, write, value.made)
                self.facts.add(self.facts.stored, str(op.argval), value.made)
                owner = owner._replace(alias=owner.alias - {_SELF})
                names[_OLD_MARK + str(op.argval)] = _EMPTY  # written on this path
                marks = _guard_marks(names)
                if marks:  # past a condition (which reads what, known at the end)
                    self.facts.add(self.facts.guarded, write, marks)
                self.changed = True
            self._change(owner.alias, value.made, names)
            return
        count = 3 if op.opname == "STORE_SUBSCR" else 4
        popped = stack[len(stack) - count :]
        del stack[len(stack) - count :]
        container = popped[1]
        made = _joined([popped[0], *popped[2:]]).made
        self._change(container.alias, made, names)

    def _change(self, alias: Iterable[Any], made: Iterable[Any], names: dict[str, _Slot]) -> None:
        """What ``made`` goes into each object a changed value may be: a local, a cell, an
        attribute of self (self itself: a write by name, which no key reads anyway)."""
        made = frozenset(made)
        for a in alias:
            if a[0] == "local":
                self.changed = True
                slot = names.get(a[1], _EMPTY)
                names[a[1]] = slot._replace(made=slot.made | made)
            elif a[0] == "cell":
                self.facts.add(self.facts.cells, a[1], made)
            elif a[0] == "attr":
                self.facts.add(self.facts.stored, a[1], made)
            elif a[0] in ("global", "changed"):
                self.facts.add(self.facts.globals, a[1], made)

    def _call(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """A call: its result is made of the callable and every argument, and of the returns
        of the code it runs; the code it runs is given its inputs; what each input may be
        may be changed by it (``out.copy_(self.x)``). ``super()`` gives self."""
        if op.opname in ("CALL", "CALL_KW"):
            popped = op.arg + (2 if op.opname == "CALL" else 3)
        else:
            popped = 1 - self._effect(op) if self._effect(op) <= 0 else 1
        pushed = 1 if self._effect(op) <= 0 else 1 + self._effect(op)
        if op.opname.startswith("CALL_INTRINSIC"):
            popped = 1 - self._effect(op)
        taken = stack[len(stack) - popped :]
        del stack[len(stack) - popped :]
        inputs = _joined(taken)
        made = set(inputs.made)
        for callee in _codes(inputs.callee):
            self.facts.add(self.facts.calls, callee, inputs.made)
            made.add(("ret", callee))
        if _OPAQUE in inputs.callee:
            made.add(_UNKNOWN)
        called = 2 if op.opname in ("CALL", "CALL_KW") else 1  # a global called is not changed
        if op.opname == "CALL_FUNCTION_EX":  # (NULL,) the callable, the arguments, (keywords)
            called = max(len(taken) - 1 - (op.arg & 1), 1)
        for held in _joined(taken[:called]).callee:  # a callable an attribute of self holds
            if held[0] in _HELD:
                made.add(("called" if held[0] == "held" else "called-via", held[1]))
        marks = _guard_marks(names)
        for callee in _codes(_joined(taken[:called]).callee):  # a method writing on every path
            if marks:
                self.facts.guarded_calls.add((self.key, callee, marks))
            for name in self.written.get(callee, ()):
                names[_OLD_MARK + name] = _EMPTY
                self.changed = True
        changed = _joined(taken[called:]).alias | {
            a for s in taken[:called] for a in s.alias if a[0] != "global"
        }
        self._change(changed - {_SELF}, inputs.made, names)
        out = _Slot(frozenset(made), changed - {_SELF}, frozenset())
        if _SUPER in inputs.callee:
            out = _Slot(_SELF_SLOT.made | out.made, _SELF_SLOT.alias, frozenset({_SUPER}))
        stack += [out] * pushed

    def _global(self, name: str) -> _Slot:
        """A global loaded: its token (what the code read stores into it), and, in the user's
        code, its value now (:meth:`_valued`); one no name holds yet is anything."""
        token = frozenset({("global", name)})
        if self.scope is None:
            return _Slot(token, token, frozenset())
        found = self.scope.get(name, _MISSING)
        if found is _MISSING:
            found = vars(builtins).get(name, _MISSING)
        return self._valued(token, token, found)

    def _valued(self, made: frozenset[Any], alias: frozenset[Any], value: Any) -> _Slot:
        """A value code of the user's loads as it is now: anything where it may hold the
        module (:func:`_holds`) or is missing; a function of the user's marks the code it
        runs (followed: :meth:`_Facts.follow`), a class of the user's code no reading follows."""
        if value is _MISSING:
            return _Slot(made | {_UNKNOWN}, alias, frozenset())
        if _holds(value):
            made |= {_UNKNOWN}
        func = method_function(value.func if isinstance(value, functools.partial) else value)
        callee: frozenset[Any] = frozenset()
        if inspect.isfunction(func) and not is_library_code(func):
            callee = frozenset({self.facts.follow(func, self.key)})
        elif isinstance(value, type) and not is_library_code(value):
            callee = frozenset({_OPAQUE})
        known = self.known.setdefault(id(value), _Known(value))
        return _Slot(made, alias, callee, known)

    def _other(self, op: Any, stack: list[_Slot], names: dict[str, _Slot]) -> None:
        """Any other op, by its stack effect: a push of a value made of nothing (a constant,
        a global; a nested code object marks the code it runs; ``super`` marks itself), a
        pop, an item put into the container below, or a value made of what it pops (an op
        not named here, or an in-place ``+=``, may change what its inputs may be)."""
        name = op.opname
        effect = self._effect(op)
        if name in _PUSHES:
            pushed = 1 if name == "RETURN_GENERATOR" else effect
            stack += [_EMPTY] * pushed
            if inspect.iscode(op.argval):
                stack[-1] = _Slot(frozenset(), frozenset(), frozenset({_key(op.argval)}))
            elif name == "LOAD_GLOBAL" and op.argval == "super":
                stack[-1] = _Slot(frozenset(), frozenset(), frozenset({_SUPER}))
            elif name in ("LOAD_GLOBAL", "LOAD_NAME"):
                stack[-1] = self._global(str(op.argval))
            return
        if name in ("STORE_GLOBAL", "STORE_NAME"):
            self.facts.add(self.facts.globals, str(op.argval), stack[-1].made)
        if name in _POPS:
            del stack[len(stack) + effect :]
            return
        if name in _INTO:
            items = _joined(stack[len(stack) + effect :])
            del stack[len(stack) + effect :]
            below = stack[-op.arg]
            stack[-op.arg] = _Slot(below.made | items.made, below.alias | items.alias, below.callee)
            return
        popped = min(len(stack), 1 - effect if effect <= 0 else 1)
        inputs = _joined(stack[len(stack) - popped :])
        del stack[len(stack) - popped :]
        makes = name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE")  # a function of nested code
        callee = inputs.callee if makes else _via(inputs.callee)  # self.fns[0]: still held
        made = inputs.made - {_SELF} if makes and callee else inputs.made
        in_place = name == "BINARY_OP" and "=" in op.argrepr
        if (name not in _PURE and name != "BINARY_OP") or in_place:
            self._change(inputs.alias - {_SELF}, inputs.made, names)
        stack += [_Slot(made, inputs.alias - {_SELF}, callee)] * (popped + effect)


#: A name no global, builtin or attribute holds.
_MISSING = object()


def _namespace(value: Any) -> bool:
    """Whether ``value`` is a module or class of the user's: its attributes read as they are."""
    return (inspect.ismodule(value) or isinstance(value, type)) and not is_library_code(value)


def _static_attribute(namespace: Any, name: str) -> Any:
    """Attribute ``name`` of a module or class as it is held (no property run), a static or
    class method as its function; :data:`_MISSING` where none is."""
    if inspect.ismodule(namespace):
        return vars(namespace).get(name, _MISSING)
    found = inspect.getattr_static(namespace, name, _MISSING)
    if isinstance(found, staticmethod):
        return found.__func__
    if isinstance(found, classmethod):
        return types.MethodType(found.__func__, namespace)  # holds the class: read as it
    return found


def _within(b: _Slot, a: _Slot) -> bool:
    """Whether ``b`` adds nothing to ``a`` (their join is ``a``)."""
    return b.made <= a.made and b.alias <= a.alias and b.callee <= a.callee


def _merge(old: _State | None, new: _State) -> _State | None:
    """``old`` where ``new`` adds nothing to it, their join, or None where their stacks differ
    in depth (code this reading cannot follow)."""
    if old is None:
        return new
    if len(old[0]) != len(new[0]):
        return None
    stack = tuple(
        a if _within(b, a) else _joined((a, b)) for a, b in zip(old[0], new[0], strict=True)
    )
    names = dict(old[1])
    for k, b in new[1].items():
        a = names.get(k)
        if a is None:
            names[k] = b
        elif not _within(b, a):
            names[k] = _joined((a, b))
    changed = any(x is not y for x, y in zip(stack, old[0], strict=True)) or names != old[1]
    return (stack, names) if changed else old


#: class -> the attributes its forward writes: derived_attributes's (weakly: a class made at
#: run time is freed as before).
_DERIVED: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()
#: class -> for each derived attribute made by calling what attributes of self hold, those
#: attributes (``conv1``, ``reader``): module_derived's, made with _DERIVED's.
_CALLED: weakref.WeakKeyDictionary[type, dict[str, frozenset[str]]] = weakref.WeakKeyDictionary()


def reached_code(code: Any, cls: type | None) -> list[Any]:
    """``code``, the code nested in it, and (for a method of ``cls``) the code of every
    method of ``cls`` it reaches by name (``self.record(x)``; a property's getter,
    ``self.context``), and theirs in turn."""
    todo: list[Any] = [code]
    seen: list[Any] = []
    while todo:
        now = todo.pop()
        if any(now is c for c in seen):
            continue
        seen.append(now)
        todo += [c for c in now.co_consts if inspect.iscode(c)]
        if cls is not None:
            for name in attribute_names(now):
                func = method_function(inspect.getattr_static(cls, name, None))
                if inspect.isfunction(func):
                    todo.append(func.__code__)
    return seen


def attribute_names(code: Any) -> frozenset[str]:
    """The names ``code`` uses as an attribute of some object (``self.record(x)``,
    ``x.float()``, ``self.pe = ...``), not those it uses only as a global or an import:
    ``float(x)`` calls the builtin, not ``nn.Module.float`` (which hands ``self`` on, so a
    class reaching it would record into no attribute). Kept per code object.

    Example:
        >>> def forward(self, x):
        ...     return float(x) + self.scale(x)
        >>> sorted(attribute_names(forward.__code__))
        ['scale']
    """
    kept = _ATTRIBUTE_NAMES.get(code)
    if kept is None:
        ops = dis.get_instructions(code)
        kept = frozenset(op.argval for op in ops if op.opname in _NAMED_ATTRIBUTE_OPS)
        _ATTRIBUTE_NAMES[code] = kept
    return kept


#: The ops that name an attribute of an object: its loads (:data:`_ATTRIBUTE_LOADS`; 3.12 adds
#: ``LOAD_SUPER_ATTR``), writes and deletes.
_NAMED_ATTRIBUTE_OPS = _ATTRIBUTE_LOADS | {"LOAD_SUPER_ATTR", "STORE_ATTR", "DELETE_ATTR"}
#: attribute_names's, by code object (code objects are hashable by value and kept alive here,
#: as a class's methods are for the life of the process).
_ATTRIBUTE_NAMES: dict[Any, frozenset[str]] = {}


def method_function(found: Any) -> Any:
    """The function a class attribute runs when read: a method (unwrapped), a property's
    getter, a ``functools.cached_property``'s function, a static or class method's."""
    if isinstance(found, property):
        found = found.fget
    elif isinstance(found, (staticmethod, classmethod)):
        found = found.__func__
    elif type(found).__name__ == "cached_property":
        found = getattr(found, "func", None)
    return unwrapped(found)


def unwrapped(func: Any) -> Any:
    """The function a decorator made with ``functools.wraps`` wraps (``@torch.no_grad()``),
    or ``func``; a wrapper chain that loops back gives ``func``."""
    try:
        return inspect.unwrap(func)
    except ValueError:
        return func


def root_id(data: str, encoder_label: str, recipe_fp: str, column: str | None = None) -> str:
    """A stable short name for the root of (data, encoder as named, recipe, and the column of
    a manifest or table the items were read from, where the user named one).

    Two builds of one parquet file with ``--column a`` and ``--column b`` are two roots (one
    name would have made the second replace the first, and gc free the first's features); with
    no column the name is what it always was.

    Example:
        >>> root_id("/data/audio", "ckpt.pt", "0" * 64)[:2]
        'r-'
        >>> root_id("/d/t.parquet", "m", "0" * 64) != root_id("/d/t.parquet", "m", "0" * 64, "b")
        True
    """
    named = [data, encoder_label, recipe_fp] + ([column] if column is not None else [])
    return "r-" + sha256_hex(canonical_json(named))[:12]
