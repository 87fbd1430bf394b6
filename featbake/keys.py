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

import collections
import dis
import hashlib
import inspect
import json
import os
import weakref
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

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


def tensor_attributes(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(submodule.name, tensor)`` of every submodule's public attribute
    (:func:`keyed_attribute`) that is a tensor and no parameter or buffer (those live in
    torch's own dicts, not in ``__dict__``), or a tensor inside a plain list, tuple or dict of
    one (``self.scales = [torch.tensor(2.0)]``, named ``scales.0``), but derived state its
    forward writes (:func:`derived_attributes`) or torch's weight reparametrising pre-hooks
    write (:func:`reparametrised_attributes`)."""
    return [
        (f"{prefix}.{path}" if prefix else path, tensor)
        for prefix, sub in module.named_modules()
        for key, value in vars(sub).items()
        if keyed_attribute(key)
        and not derived_state(derived_attributes(type(sub)), key, value)
        and key not in reparametrised_attributes(sub)
        for path, tensor in contained_tensors(key, value)
    ]


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
    names = frozenset(name for each in code for name in fresh_attribute_writes(each))
    _DERIVED[cls] = names | recorded_attributes(code)
    return _DERIVED[cls]


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
    """The attributes ``code`` (not the code nested in it) writes with a value its statement
    does not read from the attribute itself: ``self.pe = pe.to(x.device)`` (made anew: derived
    state) is one; ``self.scale = self.scale.to(x.device)`` (the value the user set, moved to
    the input's device) is not, so a forward that only moves an attribute keeps it keyed.

    Example:
        >>> def forward(self, x):
        ...     self.scale = self.scale.to(x.device)
        ...     self.pe = make(len(x)).to(x.device)
        >>> sorted(fresh_attribute_writes(forward.__code__))
        ['pe']
    """
    ins = list(dis.get_instructions(code))
    fresh: set[str] = set()
    for j, op in enumerate(ins):
        if op.opname != "STORE_ATTR":
            continue
        statement = _statement_before(ins, j)
        if not any(o.opname in _ATTRIBUTE_LOADS and o.argval == op.argval for o in statement):
            fresh.add(op.argval)
    return fresh


#: The ops that read an attribute (``self.x``, ``self.x.to(...)``).
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})

#: Ops that end a statement: what comes after them computes another statement's value.
_STATEMENT_ENDS = frozenset(
    {"STORE_ATTR", "STORE_FAST", "STORE_NAME", "STORE_GLOBAL", "STORE_DEREF", "STORE_SUBSCR",
     "DELETE_ATTR", "POP_TOP", "RETURN_VALUE"}
)  # fmt: skip


def _statement_before(ins: list[Any], j: int) -> list[Any]:
    """The instructions of the statement that ends with ``ins[j]``: back to the op that ended
    the one before (by op, not by line: a statement may span lines), or a jump target. An
    inlined comprehension (:func:`inlined_comprehensions`) is part of its statement: its
    loop's jump targets and the stores of its variables end none."""
    spans = inlined_comprehensions(ins)
    k = j
    while k > 0:
        if k - 1 in spans:
            k = spans[k - 1]
        elif ins[k - 1].opname in _STATEMENT_ENDS or ins[k].is_jump_target:
            break
        else:
            k -= 1
    return ins[k:j]


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


#: class -> the attributes its forward writes: derived_attributes's (weakly: a class made at
#: run time is freed as before).
_DERIVED: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


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
            for name in now.co_names:
                func = method_function(inspect.getattr_static(cls, name, None))
                if inspect.isfunction(func):
                    todo.append(func.__code__)
    return seen


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
