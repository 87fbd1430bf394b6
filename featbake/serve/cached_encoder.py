"""``CachedEncoder``: the seed's interceptor, a module whose forward consults the cache first.

::

    forward(x, ids=None)
      -> per-row keys: sha256(encoder_fp | recipe_fp | sha256(id or the row's dtype, shape, bytes))
      -> device LRU -> RAM LRU -> the on-disk store (one catalog query per batch)
      -> the rows that missed every tier run through the wrapped encoder, in one batch
      -> results filled back into every tier (the store gets them in this process's own shards)

It is active only when the wrapped encoder is frozen (every parameter has ``requires_grad=False``
and the module is in eval mode) and ``enabled``; otherwise it runs the encoder untouched and warns
once. The encoder's fingerprint covers its architecture, code, plain attributes and every
weight, and :class:`~featbake.serve.cached_encoder.ModuleWatch` recomputes it whenever any
of them changed (a new state dict, an in-place EMA update through ``.data``, an attribute set after
wrapping), so a changed encoder never gets the old one's features. Features encoded here are
written back through the dataset's :class:`~featbake.serve.state.WriteBack` (one sealing
policy), and outputs are named by :mod:`featbake.encode.outputs`' one rule.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.util
import multiprocessing.util as mp_util
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from featbake.encode.encoders import (
    is_frozen,
    module_device,
    refuse_held_tensors,
    refuse_meta,
    training_submodule,
)
from featbake.encode.identity import (
    GLOBAL_HOOKS,
    HOOK_DICTS,
    Calls,
    LaterRead,
    attribute_digest,
    attribute_row,
    foreign_global_hooks,
    forward_functions_and_calls,
    forward_globals,
    forward_reads,
    held_attribute,
    held_attribute_text,
    held_values,
    is_plain,
    keyed_attribute,
    later_read,
    model_config,
    module_identity,
    own_class_values,
    reads_held_attributes,
)
from featbake.encode.outputs import (
    is_tuple_parts,
    join_outputs,
    name_outputs,
    refuse_nonfinite,
    stored_parts,
)
from featbake.errors import ConfigError, EncodeError
from featbake.keys import (
    contained_tensors,
    derived_state,
    feature_key,
    module_derived,
    module_fingerprint,
    public_attributes,
    recipe_fingerprint,
)
from featbake.lru import ByteLRU, CacheInfo
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.recipe import Recipe
from featbake.serve.reads import Served, served_for
from featbake.serve.state import (
    WriteBack,
    close_at_exit,
    handed_over_sealed,
    pending_in_process,
)
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.open import open_store, place_of
from featbake.store.roots import RootSpec
from featbake.store.shard import SealedShard, crc32c_tensor, tensor_buffer
from featbake.units import parse_bytes


# == cached_encoder_keys ===========================================================================
# What CachedEncoder keys are made of: row and id digests, and a watched module fingerprint.
#
# Ids are keyed by their exact bytes (a tensor id by dtype, shape and every byte: ``str()`` of a
# long tensor abbreviates it, so two different ids would share a key). The module's fingerprint
# covers its architecture, code, plain attributes and every weight; :class:`ModuleWatch` notices
# each way it can change after wrapping, cheaply, at every forward:
#
# - weights replaced or updated through autograd-visible ops: version counters and data pointers;
# - weights updated in place behind the version counters (``p.data.mul_(0.5)``, EMA teachers):
#   a CRC-32 of every CPU tensor's bytes, or an on-device byte sum for accelerator tensors (one
#   small copy to the host per step);
# - a plain attribute set from outside (``teacher.scale = 0.5``): the attributes' digest. Changes
#   the module makes to its own attributes while running (a call counter) are taken as
#   bookkeeping: the digest is taken again after each run;
# - a submodule of another class, a forward hook added, replaced or holding other values: the
#   classes and hook objects by id (:func:`structure_read`; the key reads a hook's code and
#   what it holds, :func:`~featbake.encode.identity.hook_identity`);
# - what no key reads (a tensor attribute, ``forward`` set on the instance, torch's global
#   forward hooks): read by id and version, a change of it keyed apart, so a dataset refuses it.
def row_digest(row: torch.Tensor) -> str:
    """SHA-256 of one input row's dtype, shape and bytes (a copy to the host off the CPU)."""
    t = row.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()  # a lazy conjugate view has no bytes yet
    h = hashlib.sha256(f"row\0{t.dtype}\0{list(t.shape)}\0".encode())
    h.update(tensor_buffer(t))
    return h.hexdigest()


def id_digest(ident: Any, form: str = "") -> str:
    """SHA-256 of an id by its exact content and type (``"1"``, ``1`` and ``b"1"`` differ),
    with its row's ``form`` (:func:`row_form`: the same id padded to another length is
    another input, and was served the other length's features).

    Raises:
        ConfigError: the id is not a string, bytes, Python or numpy number, bool, None, path,
            tensor, numpy array (of numbers, strings or bytes), or a tuple or list of those.
    """
    h = hashlib.sha256(f"id\0{form}\0".encode())
    _feed(h, ident)
    return h.hexdigest()


def row_form(x: torch.Tensor) -> str:
    """The dtype and shape each row of ``x`` has, keyed beside its id: a clip padded to the
    batch's longest is another input in each batch of another length.

    Example:
        >>> row_form(torch.zeros(2, 8000)), row_form(torch.zeros(3, 80, 100, dtype=torch.half))
        ('torch.float32 [8000]', 'torch.float16 [80, 100]')
    """
    return f"{x.dtype} {list(x.shape[1:])}"


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` to ``h`` unambiguously: a type tag, a length, then the content."""
    if isinstance(value, (tuple, list)):
        h.update(f"seq:{len(value)}\0".encode())
        for v in value:
            _feed(h, v)
        return
    tag, data = _tagged(value)
    h.update(f"{tag}:{len(data)}\0".encode())
    h.update(data)


def _tagged(value: Any) -> tuple[str, Any]:
    if isinstance(value, str):  # np.str_ too: the same string, the same key
        return "str", value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, (np.ndarray, np.generic)):
        # A numpy scalar (what iterating an array gives, ``np.int64(3)``) is a 0-d array, as
        # iterating a tensor gives 0-d tensors: keyed by dtype and bytes, never by its repr
        # (numpy 2 writes ``np.float64(3.0)`` where numpy 1 wrote ``3.0``).
        return _array_tagged(np.asarray(value))
    if value is None or isinstance(value, (bool, int, float)):
        return type(value).__name__, repr(value).encode()
    if isinstance(value, os.PathLike):
        return "path", os.fsencode(value)
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return f"tensor:{t.dtype}:{list(t.shape)}", tensor_buffer(t)
    raise ConfigError(
        f"CachedEncoder cannot key an id of type {type(value).__module__}."
        f"{type(value).__qualname__} ({_short(value)}): ids must be strings, bytes, Python or "
        "numpy numbers, paths, torch tensors or numpy arrays, or tuples or lists of them, keyed "
        "by their exact content; pass e.g. str(id) or the id's number"
    )


def _array_tagged(a: np.ndarray) -> tuple[str, bytes]:
    """A numpy array (or scalar) keyed by dtype, shape and bytes; object arrays are refused."""
    if a.dtype.hasobject:
        raise ConfigError(
            f"CachedEncoder cannot key a numpy array of dtype {a.dtype} by its content (it holds "
            "Python objects); pass the ids as a list of strings or numbers"
        )
    a = np.ascontiguousarray(a)
    return f"ndarray:{a.dtype.str}:{list(a.shape)}", a.tobytes()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


#: Bytes weighed per step of :func:`_placed_sum` (its int64 temporaries: 8 bytes each, a few).
_PLACED_CHUNK = 1 << 22


def _placed_sum(b: torch.Tensor) -> torch.Tensor:
    """The sum of each byte of ``b`` (a flat uint8 tensor) times a pseudo-random weight of its
    place (1..65536, a hash of its index), as a 0-d int64 tensor on ``b``'s device. A plain
    byte sum is kept by any permutation (two output channels swapped); this one is not, save
    by chance. Weighed in chunks, so its temporaries stay small beside a large weight."""
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    for start in range(0, b.numel(), _PLACED_CHUNK):
        part = b[start : start + _PLACED_CHUNK]
        x = torch.arange(start, start + part.numel(), dtype=torch.int64, device=b.device)
        x = ((x & 0x7FFFFFFF) * 0x9E3779B1) & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x85EB) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        total += (part.to(torch.int64) * ((x & 0xFFFF) + 1)).sum()
    return total


def _device_sums(t: torch.Tensor) -> torch.Tensor:
    """A tensor's device probe, left on its device: its byte sum and :func:`_placed_sum`."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    return torch.stack([b.sum(dtype=torch.int64), _placed_sum(b)])


def device_entry(t: torch.Tensor) -> tuple[int, ...]:
    """The weight probe's entry of a tensor read where it is (on a device: no copy of its
    bytes to the host): its byte sum and its place-weighted byte sum, so a permutation of its
    rows is a change where a move kept it (:meth:`ModuleWatch._holds_trusted_values`).

    Example:
        >>> w = torch.arange(6, dtype=torch.uint8).reshape(3, 2)
        >>> entry, flipped = device_entry(w), device_entry(w.flip(0))
        >>> entry[0] == flipped[0], entry == flipped
        (True, False)
    """
    return tuple(int(v) for v in _device_sums(t).tolist())


def _weight_probe(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """A cheap digest of each tensor's bytes, one entry per tensor: CRC-32C on the CPU (the
    compiled kernel the store's reads use, about 4x zlib's CRC-32 on weights: ~8 ms for
    226 MB), a byte sum and a place-weighted byte sum on a device (:func:`device_entry`: one
    copy to the host for all of them, and order-sensitive, as a CRC is), 0 for a
    tensor without values (empty, or on the meta device). It is taken before each batch of
    misses a dataset encodes with an in-process module, so its speed is part of live
    encoding's."""
    out: list[Any] = [0] * len(tensors)
    on_device: list[torch.Tensor] = []
    where: list[int] = []
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.device.type == "cpu":
            out[i] = crc32c_tensor(t)
        elif t.numel() and not t.is_meta:
            on_device.append(_device_sums(t))
            where.append(i)
    if on_device:
        for i, sums in zip(where, torch.stack(on_device).tolist(), strict=True):
            out[i] = tuple(sums)
    return tuple(out)


def version_of(t: torch.Tensor) -> int:
    """``t``'s version counter; -1 for an inference tensor (made under
    ``torch.inference_mode()``, as a model loaded there has its weights), which keeps none:
    the weight probe alone notices it edited in place."""
    return -1 if t.is_inference() else t._version


def value_entry(t: torch.Tensor, like: Any) -> Any:
    """``t``'s weight probe entry of the kind ``like`` is (a CRC-32C where ``like`` is a
    number, a pair of byte sums where it is a pair), read wherever ``t`` is now: what tells
    a tensor moved to another device (or other storage) from one whose values changed,
    compared with the entry trusted before the move. None for a tensor without values (on
    the meta device), which no entry matches."""
    t = t.detach()
    if t.is_meta and t.numel():
        return None
    if not t.numel():
        return 0
    if isinstance(like, tuple):
        return device_entry(t)
    return crc32c_tensor(t if t.device.type == "cpu" else t.cpu())


class _Look(NamedTuple):
    """One submodule as a glance reads it: the submodule (weakly), what picks its public
    attribute values from its ``__dict__`` (None: it has none) and whether that gives a tuple
    of them, the public values that are lists (edited in place, so read by value), and its
    name and public attribute names (what a digest of the attributes is made of); ``held``:
    the held values its key reads (:func:`~featbake.encode.identity.held_attribute`: a
    settings dict, a partial), read by value too."""

    ref: weakref.ref[nn.Module]
    pick: Callable[[dict[str, Any]], Any] | None
    many: bool
    listy: tuple[str, ...]
    name: str
    public: tuple[str, ...]
    held: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class GlancePlan:
    """What a :class:`Glance` of one module tree reads: each submodule and its public
    attribute names as the tree was when planned, and its tensors (parameters then buffers,
    each once, as ``parameters()`` and ``buffers()`` give them). All held weakly: a plan
    kept by a watch never keeps a replaced submodule's or tensor's memory alive."""

    looks: tuple[_Look, ...]
    tensors: tuple[weakref.ref[torch.Tensor], ...]
    #: The (class, function) pairs of its forward that read globals or class settings
    #: (:func:`forward_globals`), read by value at each glance; none where none did when
    #: planned.
    reads: tuple[Any, ...] = ()
    #: Those that read none when planned but may later (a class setting asked by
    #: ``getattr``, a library function a script may bind anew): glanced at by what may
    #: change (:class:`LaterRead`); a change is read exactly, and planned again.
    later: tuple[LaterRead, ...] = ()
    #: The user's classes whose functions its forward runs: what they hold is glanced at by
    #: identity (a method replaced on the class, ``Cls.post = scaled_post``).
    classes: tuple[type, ...] = ()
    #: The methods its forward's functions call on submodules (:class:`Calls`): what a
    #: glance's reading of ``reads`` takes for the forward's own state, as a key's does.
    calls: Calls | None = None

    def live_tensors(self) -> list[torch.Tensor] | None:
        """The planned tensors (None: one of them is gone, so the tree changed)."""
        tensors = [ref() for ref in self.tensors]
        return None if any(t is None for t in tensors) else tensors  # type: ignore[return-value]


def glance_plan(module: nn.Module) -> GlancePlan | None:
    """The plan of a glance at ``module`` as it is now (None for a tree holding a TorchScript
    module, whose dicts are views made anew on each read: it is always read exactly)."""
    looks = []
    for name, sub in module.named_modules():
        if isinstance(sub, torch.jit.ScriptModule):
            return None
        attrs = vars(sub)
        public = tuple(filter(keyed_attribute, attrs))
        listy = tuple(k for k in public if _edited_in_place(attrs[k]))
        pick = itemgetter(*public) if public else None
        held = _held_attributes(sub, attrs, public)
        looks.append(_Look(weakref.ref(sub), pick, len(public) > 1, listy, name, public, held))
    tensors = tuple(weakref.ref(t) for t in (*module.parameters(), *module.buffers()))
    functions, calls = forward_functions_and_calls(module)
    rows = forward_reads(module, exact=False, functions=functions, calls=calls)
    reads = tuple(pair for pair, _ in rows)
    later = (later_read(*p) for p in functions if p not in reads)
    classes = tuple(dict.fromkeys(cls for cls, _ in functions))
    kept = tuple(r for r in later if r is not None)
    return GlancePlan(tuple(looks), tensors, reads, kept, classes, calls)


def _held_attributes(
    sub: nn.Module, attrs: Mapping[str, Any], public: Iterable[str]
) -> tuple[str, ...]:
    """The public attributes of ``sub`` its key reads as held values (a class of the user's:
    :func:`~featbake.encode.identity.reads_held_attributes`; any class's transformers config:
    :func:`~featbake.encode.identity.model_config`), derived state and values no key reads
    (:func:`~featbake.encode.identity.held_attribute_text` None: a tokenizer too large to key,
    an object known by its address) left out: a glance reads the rest at every forward."""
    reads_held = reads_held_attributes(sub)
    keys = [k for k in public if reads_held or model_config(attrs[k])]
    if not keys:
        return ()
    derived = module_derived(sub)
    return tuple(
        k
        for k in keys
        if held_attribute(k, attrs[k], derived)
        and held_attribute_text(sub, attrs[k], exact=False, key=k) is not None
    )


def _edited_in_place(value: Any) -> bool:
    """An attribute value that can change while it stays the same object: a plain list, or a
    tensor that is no parameter or buffer (``self.scale = torch.tensor(2.0)``, edited by
    ``mul_``), read by its version (:func:`_in_place_text`)."""
    if isinstance(value, torch.Tensor):
        return True
    if type(value) in (list, dict) and contained_tensors("", value):
        return True  # a tensor inside, keyed by value (serve10.16): read by version
    if isinstance(value, list):
        return is_plain(value)
    return isinstance(value, tuple) and any(map(_edited_in_place, value))


def _in_place_text(value: Any) -> Any:
    """What a glance reads of a value edited in place: a tensor's version and pointer, a
    list's text."""
    if isinstance(value, torch.Tensor):
        return (version_of(value), value.data_ptr())
    tensors = contained_tensors("", value) if type(value) in (list, tuple, dict) else []
    if tensors:
        return tuple((id(t), version_of(t), t.data_ptr()) for _, t in tensors)
    return repr(value)


def _glance_hooks(
    dicts: Sequence[Mapping[int, Any]], held: list[Any], hooked: list[tuple[str, ...]]
) -> None:
    """Add a glance's reading of hook dicts that hold hooks: each hook (by id), and what each
    holds by value (:func:`~featbake.encode.identity.held_values`: an attribute set on a hook
    object, a cell a closure rebinds, a dict it reads edited in place), a watch's own left
    unread."""
    for d in dicts:
        for hook in list(d.values()):  # a copy made in C: see _hook_rows
            held.append(hook)
            if not getattr(hook, "featbake_bookkeeping", False):
                hooked.append(tuple(held_values(hook)))


def _held(o: Any, died: Callable[[object], None]) -> Any:
    """``o`` as a kept glance holds it: weakly where it takes a weak reference."""
    return weakref.ref(o, died) if type(o).__weakrefoffset__ else o


@dataclass(frozen=True, eq=False)
class Glance:
    """A cheap summary of a module tree, read in well under a millisecond: which objects its
    submodules, parameters, buffers and public attributes are (by id), the dicts' sizes,
    every tensor's version counter and data pointer, and the lists among the plain attributes
    by value. Two glances of one plan that are :meth:`same` mean the module's versions,
    pointers and attributes (what :func:`~featbake.encode.identity.attribute_identity`
    digests) are the same; a difference means only that they may not be (a float set again to
    the value it had). No id is reused while a glance is compared: a glance taken holds every
    object it names, one :meth:`kept` holds weakly what takes a weak reference (modules,
    tensors) and is no longer the same as any once one of those is gone.

    ``key`` reads the tree (sizes, the dicts' ids, versions, pointers) and ``values_key`` the
    public attribute values (their ids, and the lists' text), ``held`` and ``values`` holding
    what each names."""

    plan: GlancePlan
    key: tuple[Any, ...]
    values_key: tuple[Any, ...]
    held: list[Any]
    values: list[Any]
    gone: list[bool] = field(default_factory=lambda: [False])

    def same(self, other: Glance | None) -> bool:
        """Whether ``other`` (of the same plan) read the module as it is in this glance."""
        return self.same_tree(other) and other.values_key == self.values_key  # type: ignore[union-attr]

    def same_tree(self, other: Glance | None) -> bool:
        """Whether ``other`` read the same tree: submodules, tensors (versions and pointers)
        and attribute names; its attributes' values may differ."""
        return (
            other is not None
            and other.plan is self.plan
            and not (self.gone[0] or other.gone[0])
            and other.key == self.key
        )

    def kept(self) -> Glance:
        """This glance to keep across forwards: modules and tensors held weakly (a replaced
        one's memory is freed), the small values it names (numbers, strings) held as they are."""
        gone = [False]

        def died(_: object) -> None:
            gone[0] = True

        held = [_held(o, died) for o in self.held]
        values = [_held(o, died) for o in self.values]
        return Glance(self.plan, self.key, self.values_key, held, values, gone)

    def plainly_changed(self, other: Glance) -> bool:
        """Whether ``other`` (of the same tree) differs from this glance only by attributes
        set to immutable plain values (numbers, strings, tuples of them: ``self.calls += 1``),
        which the plan reads as it reads them now: no list, which it would have to read by
        value, where it planned none."""
        ids = self.values_key[0]
        return all(
            is_plain(v) and not _edited_in_place(v)
            for v, was in zip(other.values, ids, strict=True)
            if id(v) != was
        )

    def with_values(self, other: Glance) -> Glance:
        """A kept glance of this one's tree with ``other``'s attribute values (a run changed
        them): the values it did not change are held as this glance holds them."""
        ids = self.values_key[0]
        values = [
            mine if id(new) == was else new
            for mine, new, was in zip(self.values, other.values, ids, strict=True)
        ]
        return Glance(self.plan, self.key, other.values_key, self.held, values, self.gone)

    def attribute_identity(self) -> str:
        """:func:`~featbake.encode.identity.attribute_identity` of the module as this glance
        read it (its plain public attributes, lists by their text then), without reading the
        module again: the digest a check needs of attributes a run set, made only then."""
        rows = []
        values, texts = iter(self.values), iter(self.values_key[1])
        for look in self.plan.looks:
            listy = {k: next(texts) for k in look.listy}
            held = {k: next(texts) for k in look.held}  # as a watch read them
            derived = module_derived(look.ref())
            for key in look.public:
                value = next(values)
                if isinstance(value, weakref.ref):
                    value = value()
                    if value is None:
                        continue  # held weakly: no plain value
                if derived_state(derived, key, value):
                    continue
                if key in listy and is_plain(value):
                    rows.append([look.name, key, listy[key]])
                elif is_plain(value):
                    rows.append([look.name, key, repr(value)])
                elif key in held:  # read again as a key reads it
                    text = held_attribute_text(look.ref(), value, exact=True)
                    rows += [[look.name, key, text]] if text is not None else []
        return attribute_digest(rows)


def take_glance(plan: GlancePlan) -> Glance | None:
    """A glance at the module now (None: a submodule or tensor planned, or a public attribute
    the plan names, is gone)."""
    held: list[Any] = []
    values: list[Any] = []
    sizes: list[int] = []
    texts: list[Any] = []
    hooked: list[tuple[str, ...]] = []
    extend = held.extend
    try:
        for look in plan.looks:
            sub = look.ref()
            attrs = vars(sub)  # TypeError once it is gone
            pick, listy = look.pick, look.listy
            dicts = (attrs["_modules"], attrs["_parameters"], attrs["_buffers"])
            # A hook added changes what a forward returns: hook dicts by size, read where full.
            hooks = (attrs["_forward_pre_hooks"], attrs["_forward_hooks"])
            sizes += (len(attrs), *map(len, dicts), *map(len, hooks))
            held.append(type(sub))  # another class is another forward (``__class__`` set)
            if pick is not None:
                values.extend(pick(attrs)) if look.many else values.append(pick(attrs))
            texts += [_in_place_text(attrs[k]) for k in listy]
            texts += [held_attribute_text(sub, attrs[k], exact=False, key=k) for k in look.held]
            for d in dicts:
                extend(d)
                extend(d.values())
            if hooks[0] or hooks[1]:
                _glance_hooks(hooks, held, hooked)
    except (KeyError, TypeError):
        return None
    sizes += map(len, GLOBAL_HOOKS)
    if GLOBAL_HOOKS[0] or GLOBAL_HOOKS[1]:
        _glance_hooks(GLOBAL_HOOKS, held, hooked)
    if plan.reads:  # a setting its forward reads, edited in place or bound anew
        root = plan.looks[0].ref()
        if root is None:
            return None
        texts.append(forward_globals(root, exact=False, functions=plan.reads, calls=plan.calls))
    texts += [later.now() for later in plan.later]
    for cls in plan.classes:
        extend(own_class_values(cls))
    tensors = plan.live_tensors()
    if tensors is None:
        return None
    key = (
        tuple(sizes),
        tuple(map(id, held)),
        tuple(hooked),
        tuple([version_of(t) for t in tensors]),
        tuple([t.data_ptr() for t in tensors]),
    )
    return Glance(plan, key, (tuple(map(id, values)), tuple(texts)), held, values)


class _Read(str):
    """An exact read of a module (:meth:`ModuleWatch._read_attributes`): its digest, holding
    the objects it names by id (weakly where they take a weak reference, classes as they
    are), so that while it is :meth:`alive` no other object can have their ids and two reads
    equal as strings read the same objects. A copy elsewhere (pickled) is the plain digest:
    ids mean nothing there."""

    refs: tuple[Any, ...] = ()
    unkeyed: _Read | None = None  # a fresh read's part that no key reads (structure_read)

    @classmethod
    def holding(cls, text: str, refs: tuple[Any, ...]) -> _Read:
        """``text`` holding ``refs`` (objects, or weak references to them: :func:`_pinned`)."""
        read = cls(text)
        read.refs = refs
        return read

    def alive(self) -> bool:
        """Whether every object it names is alive (a removed hook freed may lend its id)."""
        return all(not isinstance(r, weakref.ref) or r() is not None for r in self.refs)

    def tail(self) -> _Read:
        """The part after the attributes' digest: classes, hooks and other objects (what a
        glance of the same tree found the same), holding what it names."""
        return _Read.holding(self.partition("|")[2], self.refs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (str, (str(self),))


def _pinned(o: Any) -> Any:
    """``o`` as a read holds it: weakly where it takes a weak reference."""
    return weakref.ref(o) if type(o).__weakrefoffset__ else o


def same_read(now: str, trusted: str) -> bool:
    """Whether an exact read ``now`` is the ``trusted`` one: equal, and every object the
    trusted one names still alive (else an id may have been lent to another)."""
    return now == trusted and (not isinstance(trusted, _Read) or trusted.alive())


def _unkeyed(key: str, value: Any) -> bool:
    """Whether a public attribute changes what a forward returns while no key reads it: a
    tensor that is no parameter or buffer, or ``forward`` set on the instance."""
    if isinstance(value, torch.Tensor) or key == "forward":
        return True
    return type(value) in (list, tuple, dict) and bool(contained_tensors(key, value))


def _own_compiled_method(module: nn.Module, key: str, value: Any) -> bool:
    """Whether ``value`` is a TorchScript module's own compiled method, which its
    ``__getattr__`` keeps in the instance's ``__dict__`` at the first call (``forward`` set on
    the instance, seen so, made every module keyed apart after its first bare call); its code
    is the module's, read by its key."""
    return (
        isinstance(module, torch.jit.ScriptModule)
        and isinstance(value, torch.ScriptMethod)
        and value.name == key
    )


def _versions_in(key: str, value: Any) -> Any:
    """The version of a tensor attribute, or the ids and versions of the tensors inside a
    list, tuple or dict of them (:func:`~featbake.keys.contained_tensors`); None for another
    value (an instance's ``forward``)."""
    if isinstance(value, torch.Tensor):
        return version_of(value)
    tensors = contained_tensors(key, value) if type(value) in (list, tuple, dict) else []
    return tuple((id(t), version_of(t)) for _, t in tensors) or None


def _digest(rows: list[Any]) -> str:
    """A digest of rows of ids and texts, for comparison in this process only (ids, and
    ``hash`` of a string, mean nothing in another): ``hash`` of their tuple, and their count."""
    return f"{len(rows)}:{hash(tuple(rows)):x}"


class Structure(NamedTuple):
    """What :func:`structure_read` reads, each part a digest, with what it names (held as a
    :class:`_Read` holds it)."""

    plain: str  # the plain attributes' digest, as attribute_identity makes it
    keyed: str  # classes and forward hooks (the fingerprint made again reads them too)
    attributes: str  # tensor attributes and an instance's forward (changes refused, not keyed)
    global_hooks: str  # torch's global forward hooks (changes refused while they differ)
    refs: tuple[Any, ...]
    unkeyed_refs: tuple[Any, ...]


def _hook_rows(name: str, attrs: Mapping[str, Any], rows: list[Any], refs: list[Any]) -> None:
    """Add a submodule's forward hooks (by id and what each holds) to ``rows`` and ``refs``,
    a watch's own left out (:func:`~featbake.encode.identity.forward_hooks`' rule).

    Each dict is copied first and the copy walked: reading a hook allocates, so the collector
    may run a dropped watch's finalizer here, which removes that watch's hooks from the very
    dict (a forward failed with "OrderedDict mutated during iteration"). ``list(...)`` copies
    with no collection between taking the iterator and its last item (the list's items grow
    by ``realloc``; ``tuple(...)`` allocates its tracked tuple after taking the iterator)."""
    for kind in HOOK_DICTS:
        for hook in list(attrs[kind].values()):
            if not getattr(hook, "featbake_bookkeeping", False):
                refs.append(_pinned(hook))
                rows.append((name, kind, id(hook), *held_values(hook)))


def structure_read(module: nn.Module) -> Structure:
    """What in a module tree its weights and plain attributes do not read, by digest, and
    the objects it names by id: each submodule's class (another forward: a submodule
    replaced by a subclass with its weights copied, ``Sigmoid`` by ``Tanh``, ``__class__``
    set) and every forward hook by id and what it holds, which its key reads too; and what
    no key reads: tensor attributes that are no parameter or buffer (by id and version),
    ``forward`` set on the instance, torch's global forward hooks. Reads no file: a watch
    compares the objects, the code of a hook is read when the module is fingerprinted
    (:func:`~featbake.encode.identity.hook_identity`). Made at each exact check, in one pass
    with the plain attributes' digest (the rows of
    :func:`~featbake.encode.identity.attribute_identity`)."""
    plain: list[list[str]] = []
    keyed: list[Any] = []
    attributes: list[Any] = []
    refs: list[Any] = []
    unkeyed: list[Any] = []
    for name, sub in module.named_modules():
        attrs = vars(sub)
        refs.append(type(sub))  # held as it is: a class outlives its instances
        keyed.append(id(type(sub)))
        if attrs.get("_forward_pre_hooks") or attrs.get("_forward_hooks"):
            _hook_rows(name, attrs, keyed, refs)
        derived = module_derived(sub)
        reads_held = reads_held_attributes(sub)
        for key, value in attrs.items():
            if not keyed_attribute(key) or derived_state(derived, key, value):
                continue
            row = attribute_row(name, sub, key, value, derived, reads_held)
            if row is not None:
                plain.append(row)
            elif _unkeyed(key, value) and not _own_compiled_method(sub, key, value):
                unkeyed.append(_pinned(value))
                version = _versions_in(key, value)
                attributes.append((name, key, id(value), version))
        for key, value in public_attributes(sub).items():  # a TorchScript module's own
            if key not in attrs and keyed_attribute(key) and is_plain(value):
                plain.append([name, key, repr(value)])
    read = forward_globals(module, exact=False)
    if read:  # keyed: the fingerprint made again reads them exactly
        keyed.append(("<forward globals>", read))
    globals_ = foreign_global_hooks()
    unkeyed += map(_pinned, globals_)
    global_rows = [(i, id(h), *held_values(h)) for i, h in enumerate(globals_)]
    return Structure(
        attribute_digest(plain),
        _digest(keyed),
        _digest(attributes),
        _digest(global_rows),
        (*refs, *unkeyed),
        tuple(unkeyed),
    )


def _unkeyed_change(now: str, base: str) -> str:
    """Which part of what no key reads differs between two reads of it (see
    :func:`structure_read`): ``"attributes"`` (kept until trusted anew: a tensor attribute
    set back may hold other values), ``"global hooks"`` (told while they differ: a global hook
    removed changes nothing any more), or ``""``."""
    if now.partition("|")[0] != base.partition("|")[0]:
        return "attributes"
    return "global hooks" if now.partition("|")[2] != base.partition("|")[2] else ""


class _Began(NamedTuple):
    """What a run of a followed module began with: its glance where it was as trusted, or,
    where only its tensors had moved outside a run (``moved``: a device move, its values
    compared at the next miss, what the run changes still its own), as the moved tree is
    (None: its tree is read exactly); and its tensors' versions and pointers."""

    glance: Glance | None
    versions: tuple[Any, ...]
    moved: bool = False


class ModuleWatch:
    """The fingerprint of a wrapped module, recomputed whenever the module changed.

    Args:
        module: the module (frozen while caching applies).
        check_weights: digest weight bytes at every :meth:`fingerprint` call, to catch in-place
            updates that bypass version counters; False trusts version counters and data
            pointers alone (the caller promises never to write weights through ``.data``).
        identity: the identity string its fingerprint is made of (a file encoder's, which its
            attributes do not change); None: the module's own, taken again on each change.

    What it trusts is kept twice: exactly (``_seen``: versions and pointers, the weight probe,
    the attributes' digest) and as a :class:`Glance` of the same moment, which each forward of
    a followed module compares first; only where the glance differs is the exact state read.
    A tensor that moved (another device, other storage) is compared by value with the one
    trusted (:func:`value_entry`): a move is no change of weights.
    """

    def __init__(
        self, module: nn.Module, *, check_weights: bool = True, identity: str | None = None
    ) -> None:
        self.module = module
        self.check_weights = check_weights
        self.identity = identity
        self.follows_runs = False  # forward hooks trust what any run changes (follow_runs)
        self._fp: str | None = None
        self._seen: tuple[Any, ...] = ()
        # The trusted attributes' digest, or the trusted glance that makes it when asked and
        # the hooks' digest (a run that set plain attributes only: no digest at each forward).
        self._attrs: str | tuple[Glance, _Read] = ""
        self._glanced: Glance | None = None  # the trusted state's glance
        self._untrusted: Glance | None = None  # a glance of a state found changed
        # A glance of the module after the last followed run of its moved tensors, and its
        # versions then: the next forward as it left it is followed again without reading.
        self._moved: tuple[Glance, tuple[Any, ...]] | None = None
        self._before = threading.local()  # per thread: the state as a run began, if trusted
        # What no key reads as trusted (structure_read), and what of it changed since
        # ("attributes", "global hooks"; "" while none did): see _keyed_or_refused.
        self._base: _Read | None = None
        self.unkeyed_change = ""

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def _versions(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], ...]:
        return tuple((version_of(t), t.data_ptr(), t.dtype, t.shape) for t in tensors)

    def _look(self) -> Glance | None:
        """A glance at the module now, by the plan of the trusted glance (None: none yet)."""
        glanced = self._glanced
        return None if glanced is None else take_glance(glanced.plan)

    def _trusted_tensors(self) -> list[torch.Tensor] | None:
        """The module's tensors where a glance now is the trusted one's (its versions,
        pointers and attributes as then), else None."""
        look = self._look()
        return look.plan.live_tensors() if look is not None and look.same(self._glanced) else None

    def _read_attributes(self) -> _Read:
        """The exact read of the module's plain attributes and structure now, in one pass
        (:func:`structure_read`: classes, hooks, tensor attributes; a hook added or replaced
        after the module was trusted changes its outputs as an attribute set does)."""
        read = structure_read(self.module)
        text = f"{read.plain}|{read.keyed}|{read.attributes}|{read.global_hooks}"
        out = _Read.holding(text, read.refs)
        # What no key reads, apart: a change of it is refused, not keyed (see fingerprint).
        out.unkeyed = _Read.holding(f"{read.attributes}|{read.global_hooks}", read.unkeyed_refs)
        return out

    def trusted_attributes(self) -> str:
        """The digest of the attributes as trusted (made from the trusted glance where a run
        set them: :meth:`Glance.attribute_identity`, with the hooks read last, which the
        glance, reading the hook dicts, found the same)."""
        if isinstance(self._attrs, tuple):
            glance, rest = self._attrs
            self._attrs = _Read.holding(f"{glance.attribute_identity()}|{rest}", rest.refs)
        return self._attrs

    def _trust_values(self, glance: Glance) -> None:
        """Take the attributes as ``glance`` read them (a run set plain attributes only):
        their digest made when asked, with the hooks of the attributes trusted before."""
        attrs = self._attrs
        if isinstance(attrs, tuple):
            rest = attrs[1]
        else:  # a plain digest (a copy pickled) holds nothing
            rest = attrs.tail() if isinstance(attrs, _Read) else _Read(attrs.partition("|")[2])
        self._attrs = (glance, rest)

    def _state(self, tensors: list[torch.Tensor], trusted: bool) -> tuple[Any, ...]:
        """(versions and pointers, weight probe, attributes) now; where the glance is the
        ``trusted`` one, the versions and attributes are the trusted ones, unread."""
        if trusted:
            versions, attrs = self._seen[0], self._attrs
        else:
            versions, attrs = self._versions(tensors), self._read_attributes()
        probe = _weight_probe(tensors) if self.check_weights else ()
        return versions, probe, attrs

    def _as_trusted(self, state: tuple[Any, ...]) -> bool:
        return (
            self._fp is not None
            and state[:2] == self._seen[:2]
            and (state[2] is self._attrs or same_read(state[2], self.trusted_attributes()))
        )

    def _holds_trusted_values(self, tensors: list[torch.Tensor], state: tuple[Any, ...]) -> bool:
        """Whether the module now is the trusted one, its tensors compared by value: each
        holds the dtype, shape and (by its probe) the values trusted, wherever it is now (a
        move to another device, into shared memory, or to the meta device and back), and its
        attributes are as trusted."""
        before, kept = self._seen[:2] if self._seen else ((), ())
        versions, probe, attrs = state
        if self._fp is None or not self.check_weights or len(versions) != len(before):
            return False
        same_attrs = attrs is self._attrs or same_read(attrs, self.trusted_attributes())
        if not same_attrs or len(kept) != len(before):
            return False
        for t, now, was, entry, read in zip(tensors, versions, before, kept, probe, strict=True):
            if now[2:] != was[2:]:
                return False  # another dtype or shape
            same_kind = isinstance(entry, tuple) == isinstance(read, tuple)
            if (read if same_kind else value_entry(t, entry)) != entry:
                return False
        return True

    def _glance_again(self) -> None:
        """Glance at the module as it is trusted now, planned afresh (its tree may differ)."""
        plan = glance_plan(self.module)
        look = None if plan is None else take_glance(plan)
        self._glanced = None if look is None else look.kept()
        self._untrusted = self._moved = None

    def fingerprint(self) -> str:
        """The module's fingerprint now (identity and every weight), recomputed on change;
        a module whose tensors only moved (:meth:`_holds_trusted_values`) keeps its own."""
        trusted = self._trusted_tensors()
        tensors = trusted if trusted is not None else self._tensors()
        state = self._state(tensors, trusted is not None)
        if not self._as_trusted(state):
            if not self._holds_trusted_values(tensors, state):
                refuse_meta(type(self.module).__name__, self.module, "")  # no values to hash
                refuse_held_tensors(type(self.module).__name__, self.module)
                identity = self.identity or module_identity(self.module)
                self._fp = self._keyed_or_refused(
                    module_fingerprint(self.module, identity), state[2]
                )
            self._seen, self._attrs = state, state[2]
        if trusted is None:  # else the trusted glance still reads the state trusted now
            self._glance_again()
        assert self._fp is not None
        return self._fp

    def _keyed_or_refused(self, fp: str, read: str) -> str:
        """``fp``, the module's fingerprint made again, where what no key reads (tensor
        attributes, an instance's ``forward``, global hooks: :func:`structure_read`) is as
        trusted; else a fingerprint of its own (one no dataset has: its misses refused,
        ``CachedEncoder``'s keyed apart), for a tensor attribute or ``forward`` from then on
        until trusted anew, for global hooks while they differ from those trusted (torch's
        own left out: :func:`foreign_global_hooks`): a change of what the key does not read
        is a change all the same."""
        now = getattr(read, "unkeyed", None)
        if self._base is None:
            self._base = now
        base = self._base
        if self.unkeyed_change != "attributes":  # a global hook's verdict follows them now
            self.unkeyed_change = ""
            if now is not None and base is not None and not same_read(now, base):
                self.unkeyed_change = _unkeyed_change(now, base) or "attributes"
        if not self.unkeyed_change:
            return fp
        return hashlib.sha256(f"{fp}|changed unkeyed: {self.unkeyed_change}".encode()).hexdigest()

    def _rebase(self) -> None:
        """Take what no key reads as it is now as the module's own (a trusted run changed it,
        or the caller trusts the module), unless a change of it was found before."""
        if not self.unkeyed_change:
            self._base = getattr(self._attrs, "unkeyed", None)

    def trust(self, fp: str) -> None:
        """Take ``fp`` as the module's fingerprint as it is now (the caller just computed it):
        :meth:`fingerprint` hashes the weights again only once the module changed."""
        tensors = self._tensors()
        probe = _weight_probe(tensors) if self.check_weights else ()
        self._attrs = self._read_attributes()
        self._fp, self._seen = fp, (self._versions(tensors), probe, self._attrs)
        self.unkeyed_change = ""
        self._rebase()
        self._glance_again()

    def ran(self) -> None:
        """The module just ran: attribute changes it made itself are bookkeeping, not a change."""
        self._attrs = self._read_attributes()
        self._rebase()
        self._glanced = None  # the run may have moved a version, which that glance would hide

    def follow_runs(self) -> bool:
        """Trust what every run of the module changes in itself, whoever calls it (a call
        counter, a buffer it replaces): forward hooks take its state before and after each run,
        and a module as trusted before a run is trusted as it is after. A change made outside
        a run is still seen. False when the module takes no hooks (a TorchScript module)."""
        if self.follows_runs:
            return True
        ref = weakref.ref(self)
        try:
            handles = [
                self.module.register_forward_pre_hook(_RunHook(ref, True)),
                self.module.register_forward_hook(_RunHook(ref, False)),
            ]
        except RuntimeError:
            return False  # "register_forward_pre_hook is not supported on ScriptModules"
        for handle in handles:
            weakref.finalize(self, handle.remove)
        self.follows_runs = True
        return True

    def run_began(self) -> None:
        """A forward begins: keep the glance and versions it begins with if the module is as
        trusted, else None. A glance the same as the trusted one's says so without reading the
        attributes (the whole of a forward's cost, a fraction of a millisecond); no weight is
        read here: a write behind the version counters before the run is still seen by the
        trusted probe, kept across a run that moved no version or pointer (:meth:`run_ended`)."""
        kept = self._as_moved_left()  # first where its tensors moved: one glance, as trusted
        if kept is None:
            look = self._look()
            if look is not None and self._fp is not None and look.same(self._glanced):
                kept = _Began(look, self._seen[0])
            elif look is None or not look.same(self._untrusted):
                kept = self._began_changed(look)
            # else: as it was when last found changed, still changed
        self._before.__dict__.setdefault("stack", []).append(kept)

    def _as_moved_left(self) -> _Began | None:
        """A run of a module whose tensors moved, where the module is as the last followed
        run left it (a glance): followed again, nothing read (a teacher moved to the GPU and
        run each step, with no miss to compare its values)."""
        if self._moved is None:
            return None
        glance, versions = self._moved
        look = take_glance(glance.plan)
        return _Began(look, versions, moved=True) if glance.same(look) else None

    def _began_changed(self, look: Glance | None) -> _Began | None:
        """The exact check where the glance differs: the module may still be as trusted (an
        attribute set again to its value, a new plan), or its tensors only moved (a device
        move: no weight is read in a forward, their values are compared at the next miss,
        and the run is followed all the same); glanced again where it is as trusted."""
        versions = self._versions(self._tensors())
        seen = self._seen[0] if self._fp is not None else None
        if (
            seen is not None
            and moved_only(versions, seen)
            and same_read(self._read_attributes(), self.trusted_attributes())
        ):
            if versions == seen:
                self._glance_again()
                return _Began(self._glanced, versions)
            plan = glance_plan(self.module)  # the moved tree's own (its old tensors are gone)
            moved = None if plan is None else take_glance(plan)
            self._moved = None if moved is None else (moved.kept(), versions)
            return _Began(moved, versions, moved=True)
        if look is not None and self._glanced is not None and look.plan is self._glanced.plan:
            self._untrusted = look.kept()
        return None

    def run_ended(self) -> None:
        """A forward ended: a module trusted as it began is trusted as it is now. Where the
        glance did not move, nothing is read; where only plain attributes did (a call counter),
        the glance is trusted as it is, and its digest made only when a check needs it; the
        weights are read again only where the run moved a version or pointer (a buffer it
        replaced)."""
        stack = self._before.__dict__.get("stack")
        began = stack.pop() if stack else None
        if began is None:
            return
        if began.moved:
            self._moved_run_ended(began)
            return
        look = None if began.glance is None else take_glance(began.glance.plan)
        if look is not None and look.same(began.glance):
            return  # the run changed nothing the watch reads
        trusted = self._glanced
        if (
            look is not None
            and trusted is not None
            and trusted.same(began.glance)
            and trusted.same_tree(look)
            and trusted.plainly_changed(look)
        ):
            self._glanced = trusted.with_values(look)  # the run's own plain attributes
            self._moved = None
            self._trust_values(self._glanced)
            return
        tensors = self._tensors()
        versions = self._versions(tensors)
        probe = self._probe_after(tensors, versions, began.versions)
        self._attrs = self._read_attributes()
        self._rebase()
        self._seen = (versions, probe, self._attrs)
        self._glance_again()

    def _moved_run_ended(self, began: _Began) -> None:
        """A run of a module whose tensors had moved ended: its attributes and the tensors
        it moved are its own (read again), and every other tensor keeps its trusted version
        and probe entry, so the next miss still compares it by value with the one trusted
        (:meth:`_holds_trusted_values`). Where its glance did not move, nothing is read; where
        only plain attributes did, the glance is taken as it is (as for a trusted run)."""
        look = None if began.glance is None else take_glance(began.glance.plan)
        left = self._moved
        if look is not None and left is not None and left[0].same(began.glance):
            if look.same(began.glance):
                return  # the run changed nothing the watch reads
            if left[0].same_tree(look) and left[0].plainly_changed(look):
                self._moved = (left[0].with_values(look), left[1])
                self._trust_values(self._moved[0])
                return
        tensors = self._tensors()
        versions = self._versions(tensors)
        seen, kept = self._seen[0], self._seen[1]
        self._moved = None
        if len(versions) != len(seen):
            return  # the run added a tensor: its values are checked with the rest, as changed
        before = began.versions
        carried = matched_entries(versions, before, seen)
        self._seen = (
            tuple(c if c is not None else v for c, v in zip(carried, versions, strict=True)),
            matched_probe(tensors, versions, before, kept) if self.check_weights else (),
            self._seen[2],
        )
        self._attrs = self._read_attributes()
        self._rebase()
        plan = glance_plan(self.module)
        moved = None if plan is None else take_glance(plan)
        self._moved = None if moved is None else (moved.kept(), versions)

    def _probe_after(
        self, tensors: list[torch.Tensor], versions: tuple[Any, ...], before: tuple[Any, ...]
    ) -> tuple[Any, ...]:
        """The weight probe after a trusted run: the tensors whose version or pointer the run
        moved (a buffer it replaced) or made (a buffer made on first use) read again, every
        other one keeping its trusted entry (:func:`matched_probe`), so a write behind a
        version counter made before the run is still seen at the next check (reading them all
        again took that write as the run's)."""
        kept = self._seen[1]
        if not self.check_weights or versions == before:
            return kept
        return matched_probe(tensors, versions, before, kept)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fp"] = None  # fingerprinted again where it lands
        state["follows_runs"] = False  # hooks do not travel (see _RunHook)
        state["_glanced"] = state["_untrusted"] = None  # ids mean nothing elsewhere
        state["_base"] = None  # taken again where it lands; a change found here is carried
        state["_attrs"] = self.trusted_attributes()
        del state["_before"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._before = threading.local()


def moved_only(versions: Sequence[Any], before: Sequence[Any]) -> bool:
    """Whether tensors read as ``versions`` (version, pointer, dtype, shape) are those read
    as ``before``, or moved (another pointer, the same dtype and shape: a device move, a
    checkpoint loaded with ``assign=True``), none edited where it is (a version moved at the
    same pointer: an EMA step's ``mul_``, which needs no weight read to be a change).

    >>> moved_only([(1, 16, "f", (2,))], [(0, 8, "f", (2,))]), moved_only([(1, 8)], [(0, 8)])
    (True, False)
    """
    return len(versions) == len(before) and all(
        now == was or (now[1] != was[1] and now[2:] == was[2:])
        for now, was in zip(versions, before, strict=True)
    )


def matched_entries(
    versions: Sequence[Any], before: Sequence[Any], kept: Sequence[Any]
) -> list[Any]:
    """For each tensor read as ``versions`` after a run, the entry of ``kept`` of the tensor
    it was before the run (matched by version and pointer in ``before``), or None where the
    run moved or made it. Where ``kept`` does not match ``before`` (none kept), all are None.

    >>> matched_entries([(0, 8), (1, 9)], [(0, 8), (0, 9)], ["a", "b"])
    ['a', None]
    """
    if len(kept) != len(before):
        return [None] * len(versions)
    olds: dict[Any, list[int]] = {}
    for i, was in enumerate(before):
        olds.setdefault(was, []).append(i)
    out: list[Any] = []
    for now in versions:
        same = olds.get(now)
        out.append(kept[same.pop(0)] if same else None)
    return out


def matched_probe(
    tensors: Sequence[torch.Tensor],
    versions: Sequence[Any],
    before: Sequence[Any],
    kept: Sequence[Any],
) -> tuple[Any, ...]:
    """The weight probe of ``tensors`` after a run: a tensor whose (version, pointer) was one
    before the run keeps that one's trusted entry in ``kept`` (so a write behind its version
    counter made before the run is still seen), the others (moved by the run, or made by it)
    are read. Where ``kept`` does not match ``before`` (no probe trusted), all are read.

    >>> matched_probe([], [], [(0, 8)], ["w"])
    ()
    """
    probe = matched_entries(versions, before, kept)
    fresh = [j for j, entry in enumerate(probe) if entry is None]
    for j, entry in zip(fresh, _weight_probe([tensors[j] for j in fresh]), strict=True):
        probe[j] = entry
    return tuple(probe)


class _RunHook:
    """A forward (pre-)hook telling a :class:`ModuleWatch` that its module's run began or
    ended; it keeps the watch weakly, and a copy of the module (pickled, deep-copied) gets a
    hook that does nothing: the copy is not the module watched."""

    #: Left out of the module's identity (:func:`~featbake.encode.identity.hook_identity`):
    #: it changes nothing a forward returns.
    featbake_bookkeeping = True

    def __init__(self, watch: weakref.ref[ModuleWatch], began: bool) -> None:
        self.watch, self.began = watch, began

    # Run as it is under torch.compile (see _untraced_when_dynamo_loads): dynamo tracing it
    # would break the graph at each tensor it reads (a CRC kernel it cannot trace).
    def __call__(self, module: nn.Module, *args: Any) -> None:
        watch = self.watch()
        if watch is not None:
            watch.run_began() if self.began else watch.run_ended()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_no_hook, ())


class _UntracedWhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Marks :class:`_RunHook`'s call ``torch.compiler.disable`` once ``torch._dynamo`` is
    loaded (at once if it is): marking it at import loaded dynamo in every process that imports
    featbake (a spawned DataLoader worker, a CLI command), as long as torch's own import, for
    a tracing that only a process which loads dynamo does."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # the import below finds the module itself
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def load_then_mark(module: Any) -> None:
            load(module)
            _mark_untraced()

        loader.exec_module = load_then_mark
        return spec


def _mark_untraced() -> None:
    call = _RunHook.__call__
    if not getattr(call, "_torchdynamo_disable", False):
        _RunHook.__call__ = torch.compiler.disable(call)  # type: ignore[method-assign]


if "torch._dynamo" in sys.modules:
    _mark_untraced()
else:
    sys.meta_path.insert(0, _UntracedWhenDynamoLoads())


def _no_hook() -> Callable[..., None]:
    return _ignore_run


def _ignore_run(*args: Any) -> None:
    return None


_ignore_run.featbake_bookkeeping = True  # type: ignore[attr-defined]


#: module -> identity -> its one watch (weakly: the watch lives while a dataset holds it).
_WATCHES: weakref.WeakKeyDictionary[nn.Module, dict[str | None, weakref.ref[ModuleWatch]]] = (
    weakref.WeakKeyDictionary()
)


def shared_watch(module: nn.Module, identity: str | None = None) -> ModuleWatch:
    """The one watch of ``module`` (fingerprinted with ``identity``, None: its own) that
    every dataset given it shares, following every run of it (:meth:`ModuleWatch.follow_runs`):
    what one dataset's misses, another's or the user's own call change in it while it runs is
    bookkeeping for all of them, where a watch of each saw the others' runs as a change."""
    watches = _WATCHES.setdefault(module, {})
    ref = watches.get(identity)
    watch = ref() if ref is not None else None
    if watch is None:
        watch = ModuleWatch(module, identity=identity)
        watch.follow_runs()
        watches[identity] = weakref.ref(watch)
    return watch


# == cached_encoder ================================================================================
#: What sits between an input row and the stored output here: nothing but the module itself.
CACHED_ENCODER_RECIPE = {"kind": "cached-encoder", "version": 1}


def refuse_call(x: Any, args: Sequence[Any], kwargs: Mapping[str, Any], ids: Any) -> None:
    """Refuse a :meth:`CachedEncoder.forward` call it cannot key (see there).

    Raises:
        ConfigError: what is wrong with the call, and what to do.
    """
    if args or kwargs:
        given = [f"{len(args)} more positional" if args else "", ", ".join(kwargs)]
        raise ConfigError(
            f"CachedEncoder passes one input batch to the encoder, and was given "
            f"{' and '.join(g for g in given if g)} argument(s): the output would depend on "
            "what its keys do not name. Pass ids by name (ids=...); wrap an encoder of several "
            "inputs (a mask, lengths) in a module taking one tensor, or call it uncached"
        )
    if not isinstance(x, torch.Tensor):
        raise ConfigError(
            f"CachedEncoder takes one tensor batch (rows along its first dimension), got "
            f"{type(x).__name__}; wrap an encoder of other inputs in a module taking one tensor"
        )
    if isinstance(ids, (str, bytes)):
        raise ConfigError(
            f"ids is one {type(ids).__name__} ({ids[:40]!r}), which would be read as one id per "
            "character; give a list of one id per row"
        )


def autocast_now(device: torch.device) -> torch.dtype | None:
    """The dtype ambient autocast runs ops on ``device`` in (None: autocast is off there)."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


#: What every ``nn.Module`` holds itself (its parameters, submodules, hooks, flags), which
#: :func:`tree_state` passes over: its buffers are read, and every attribute a class adds.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"_buffers"}


class TreeState(NamedTuple):
    """What one walk of a module tree found that keeps caching off: whether a submodule may
    run in train mode (its ``.training``, or a ``torch.fx`` graph, whose ops say: read by
    :func:`training_submodule`), how many parameters require grad, and the tensors held
    outside the parameters that require grad."""

    training: bool
    trainable: int
    held_trainable: list[str]


def tree_state(module: nn.Module, *, held: bool) -> TreeState:
    """One walk of ``module``'s tree (~2 us a submodule): whether any may run in train mode,
    how many parameters require grad (each once, as ``parameters()`` counts a tied one) and,
    with ``held``, the names of the tensors it holds outside its parameters (buffers, plain
    tensor attributes and those in lists, tuples and dicts) that require grad: a learned
    prompt kept as a plain tensor, which a cached row would drop from the graph."""
    training, found = False, []
    trainable: set[int] = set()  # ids: a tied parameter counted once
    compiled: list[torch.Tensor] = []  # a TorchScript module's, kept alive while ids count
    for sub in module.modules():
        attrs = vars(sub)
        if isinstance(sub, torch.jit.ScriptModule):  # its mode and parameters live in its `_c`
            training = training or getattr(sub, "training", False)  # frozen: none, eval
            compiled.extend(p for p in sub.parameters(recurse=False) if p.requires_grad)
            trainable.update(id(p) for p in compiled)
            continue
        training = training or bool(attrs.get("training")) or isinstance(sub, torch.fx.GraphModule)
        trainable.update(id(p) for p in attrs["_parameters"].values() if p is not None
                         and p.requires_grad)  # fmt: skip
        if not held:
            continue
        for attr in attrs.keys() - _MODULE_INTERNALS:
            if _requires_grad(attrs[attr]):
                name = next(n for n, m in module.named_modules() if m is sub)
                found.append(f"{name}.{attr}" if name else attr)
    return TreeState(training, len(trainable), sorted(found))


def _requires_grad(value: Any) -> bool:
    """Whether ``value`` is a tensor that requires grad, or a list, tuple or dict (a module's
    ``_buffers``) holding one."""
    kind = type(value)
    if kind is list or kind is tuple or isinstance(value, dict):
        inner = value.values() if isinstance(value, dict) else value
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in inner)
    return isinstance(value, torch.Tensor) and value.requires_grad


def refuse_uneven_rows(rows: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str]) -> None:
    """Refuse rows of one call whose outputs differ in shape (they cannot form one batch).

    Raises:
        EncodeError: which part, the shapes, and the likely causes.
    """
    for name in names:
        shapes = {tuple(r[name].shape) for r in rows}
        if len(shapes) > 1:
            raise EncodeError(
                f"CachedEncoder's rows for output {name or 'tensor'} have shapes "
                f"{sorted(shapes)[:3]}, which do not make one batch: a row cached from another "
                "call's shape (an id given to inputs padded differently: an id must name one "
                "input, its padding included), or an encoder whose rows depend on their batch "
                "(key such rows by their bytes: no ids)"
            )


def _split(result: Any, batch: int) -> dict[str, torch.Tensor]:
    """The encoder's per-row outputs by part name (the store's one naming rule)."""
    if isinstance(result, Mapping) and (odd := [k for k in result if not isinstance(k, str)]):
        raise EncodeError(
            f"CachedEncoder needs dict outputs named by strings; the encoder's output has the "
            f"key {odd[0]!r} ({type(odd[0]).__name__}), which it would hand back as a string "
            "(or lose beside the same name); rename the outputs"
        )
    if isinstance(result, Mapping) and (
        is_tuple_parts([str(k) for k in result]) or any(not str(k) for k in result)
    ):
        raise EncodeError(
            "CachedEncoder needs dict outputs with non-empty names that are not all numbers "
            "(those name a tuple's elements); rename the outputs"
        )
    try:
        parts = name_outputs(result)
    except EncodeError as e:
        raise EncodeError(f"{e}; CachedEncoder caches a tensor, a tuple or a dict of them") from e
    for name, v in parts.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != batch:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise EncodeError(
                f"encoder output {name or 'tensor'} is {shape}, expected a leading batch "
                f"dimension of {batch}; CachedEncoder caches per-row outputs"
            )
    return parts


def refuse_dependent_rows(
    encoder: nn.Module, x: torch.Tensor, parts: dict[str, torch.Tensor]
) -> None:
    """Check, once, that ``x``'s rows are independent inputs: its last row encoded alone gives
    its row of the batch's outputs (up to the rounding of a smaller batch). A module whose
    dimension 0 is time (``nn.LSTM``'s and ``nn.TransformerEncoder``'s default
    ``batch_first=False``: ``[T, B, D]``) had each time step cached as a row and served, in a
    later call sharing some, time steps of other sequences (3.0 off, no warning).

    Raises:
        EncodeError: the row alone gives other outputs (or none of one row).
    """
    alone = _split(encoder(x[-1:]), 1)
    for name, whole in parts.items():
        one, row = alone.get(name), whole[-1]
        if one is not None and one[0].shape == row.shape and not row.is_floating_point():
            continue  # codes (k-means ids): a near tie may flip under another batch's rounding
        if one is None or one[0].shape != row.shape or not _close(one[0], row):
            raise EncodeError(
                f"the encoder's output {name or 'tensor'} for a batch's last row differs when "
                "that row is encoded alone: CachedEncoder caches dimension 0 of x as "
                "independent rows, and this encoder's rows are not (a time-first module, "
                "batch_first=False, takes [T, B, D]; or one that mixes a batch's rows): pass "
                "x as [B, ...] (batch_first=True, or transpose in a wrapper module)"
            )


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Floating tensors equal up to the rounding a smaller batch may bring (float32 or wider:
    1e-2 of the largest finite value, room for a GPU's TF32 convolutions; a half-precision
    dtype's: 5e-2), their infinities and NaNs where each other's are (a log energy of zero
    padding is -inf). A time-first module's steps are far apart (an LSTM's 0.3 of its
    largest).

    Example:
        >>> _close(torch.tensor([1.0, -float("inf")]), torch.tensor([1.001, -float("inf")]))
        True
        >>> _close(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
        False
    """
    wide = want.dtype in (torch.float32, torch.float64)
    tolerance = 1e-2 if wide else 5e-2
    got, want = got.detach().double(), want.detach().double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return False
    if not torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num()):
        return False  # +inf where -inf was, or NaN where an infinity was
    if not bool(finite.any()):
        return True
    scale = want[finite].abs().max().item()
    diff = (got[finite] - want[finite]).abs().max().item()
    return diff <= tolerance * scale + 1e-6


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` where it alone fills its storage (a row just copied to the device), else a copy
    of it (a row of the encoder's output batch): what a cache tier may keep, holding nothing
    another tensor shares, nor the rest of a batch alive.

    Example:
        >>> batch = torch.zeros(2, 3)
        >>> own_storage(batch[1]).untyped_storage().nbytes(), own_storage(batch) is batch
        (12, True)
    """
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.storage_offset() == 0 and t.is_contiguous() else t.clone()


def stored_dtype(
    dtype: str | None, serve_dtype: str | torch.dtype | None
) -> tuple[Recipe | None, Served | None]:
    """The recipe rows are stored by (None: as the encoder returns them), and how int8/fp8
    rows are served.

    Raises:
        ConfigError: an unknown dtype, or ``serve_dtype`` for a float (or no) dtype.
    """
    if dtype is None:
        if serve_dtype is not None:
            raise ConfigError("serve_dtype applies to dtype='int8' or 'fp8'; pass one of them")
        return None, None
    recipe = Recipe(dtype=dtype)
    return recipe, served_for(recipe, serve_dtype, True)


def _row_name(ids: Sequence[Any] | None, j: int) -> str:
    """Row ``j`` of a call, as an error names it: by its id where the call gave ids."""
    return f"the row with id {ids[j]!r}" if ids is not None else f"row {j} of the batch"


def cached_encoder_root(encoder_fp: str, recipe_fp: str) -> str:
    """The name of the root that keeps a CachedEncoder's stored features live for gc."""
    return f"cached-encoder-{encoder_fp[:12]}-{recipe_fp[:8]}"


def publish_with_root(label: str, catalog: Catalog, shard: SealedShard) -> None:
    """Commit a CachedEncoder shard: its keys join the encoder's root, then its rows.

    The keys join the root *before* their rows exist, so a gc running between the two
    transactions never sees the rows unreached. One root per (encoder, recipe): `featbake roots
    drop` or `gc --older-than` retire it like any build's root.
    """
    fp = shard.encoder_fp
    spec = RootSpec(
        cached_encoder_root(fp, shard.recipe_fp), f"cached-encoder:{fp[:12]}", label, fp,
        shard.recipe_fp, CACHED_ENCODER_RECIPE,
    )  # fmt: skip
    catalog.extend_root(spec, sorted({e.key for e in shard.entries}))
    catalog.add_shard(shard)


class CachedEncoder(ProcessLocalState, nn.Module):
    """Wrap a frozen encoder so each input row is encoded once, ever.

    Args:
        encoder: the module to wrap; called as ``encoder(x)`` on a batch ``[B, ...]`` that
            returns a tensor ``[B, ...]``, a tuple or a dict of them.
        cache: the store: a directory or a bucket URL (``s3://``, ``gs://``, ``az://``; read
            through this node's local tier, write-backs sealed into fragments published to the
            bucket for `featbake merge`), default ``$FEATBAKE_CACHE`` or ``./.featbake``;
            ``None`` with ``store=False`` keeps everything in memory.
        enabled: turn caching off without unwrapping.
        ram_cache: byte budget of the host-memory tier (0 disables it).
        device_cache: byte budget of a tier on the outputs' device, for CUDA encoders (0: none).
        store: use (and write back to) the on-disk store.
        check_weights: digest the weights' bytes at every forward, so in-place updates that
            bypass version counters (``p.data.mul_(0.5)``) are noticed; False trusts version
            counters alone (cheaper for a large model on the CPU).
        clock: monotonic seconds, for write-back ageing (tests pass a fake clock).
        dtype: store (and keep in RAM) outputs as ``featbake build --dtype`` does: a float
            dtype, or ``"int8"`` / ``"fp8"`` (a quarter of float32's bytes, so 4x the rows in
            the same ``ram_cache``). ``None`` (the default) keeps the encoder's own dtype and
            the keys it always had; each dtype has its own keys.
        serve_dtype: the dtype int8/fp8 rows are dequantised to (default ``"float16"``), on
            the output's device after the copy. A row encoded now is returned as a cached one
            will be (quantised, then dequantised), so hits and misses agree.

    Keys come from ``ids`` when given (one per row, e.g. a file path, an utterance id or an id
    tensor, keyed by its exact content and the row's dtype and shape: the caller promises that
    an id at one padded length always names the same input), else from each row's dtype, shape
    and bytes (which costs a copy to the host for a CUDA input). Results equal calling the
    encoder directly, up to the batch-size-dependent rounding of its kernels, since misses are
    encoded as a smaller batch. Dimension 0 of ``x`` must be independent rows: the first call
    that encodes several rows encodes its last row alone once more to check it, and refuses a
    time-first (``batch_first=False``) module.

    Example:
        >>> teacher = CachedEncoder(frozen_teacher, cache=".featbake")  # doctest: +SKIP
        >>> feats = teacher(wav_batch, ids=utterance_ids)  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 - the public options, one keyword each (as the dataset)
        self,
        encoder: nn.Module,
        cache: str | Path | None = None,
        *,
        enabled: bool = True,
        ram_cache: int | str = "1GiB",
        device_cache: int | str = 0,
        store: bool = True,
        check_weights: bool = True,
        clock: Callable[[], float] = time.monotonic,
        dtype: str | None = None,
        serve_dtype: str | torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(encoder, nn.Module):
            raise ConfigError(
                f"CachedEncoder wraps an nn.Module, got {type(encoder).__name__}; load a saved "
                "encoder first (torch.jit.load(path)), or serve a data folder by the encoder's "
                "path with CachedFeatureDataset(data, encoder=path)"
            )
        self.encoder = encoder
        self.enabled = enabled
        self._ram: ByteLRU[str, Any] = ByteLRU(parse_bytes(ram_cache))
        self._dev: ByteLRU[str, Any] = ByteLRU(parse_bytes(device_cache))
        self._recipe, self._served = stored_dtype(dtype, serve_dtype)
        spec = CACHED_ENCODER_RECIPE if dtype is None else {**CACHED_ENCODER_RECIPE, "dtype": dtype}
        self._recipe_spec = spec
        self._recipe_fp = recipe_fingerprint(spec)
        self._watch = ModuleWatch(encoder, check_weights=check_weights)
        self._clock = clock
        self._warned_for: tuple[str, ...] = ()  # what kept caching off when last said
        # A directory or a bucket store (its local tier), as a dataset's write-back opens it.
        self._layout = open_store(cache).ensure() if store else None
        # Where the place says so (a bucket, a shared filesystem): the catalog only read,
        # write-backs sealed into fragments the place keeps (a bucket: uploaded after their
        # shards), found by other processes once `featbake merge` folded them in.
        self._shared = self._layout is not None and place_of(self._layout).serving_mode()
        # Whether a batch's last row, encoded alone, was seen to equal its row of the batch.
        self._rows_checked = False
        self.stats = {
            "hits_device": 0, "hits_ram": 0, "hits_store": 0, "hits_pending": 0, "encoded": 0
        }  # fmt: skip

    def _new_writeback(self) -> WriteBack | None:
        if self._layout is None:
            return None
        writeback = WriteBack(
            self._layout,
            self._recipe_fp,
            publish=partial(publish_with_root, type(self.encoder).__name__),
            clock=self._clock,
            what="CachedEncoder features",
        )
        # Sealed when the wrapper is collected, at exit, and as a DataLoader worker ends: a
        # multiprocessing Finalize, which a worker runs before its os._exit (a
        # weakref.finalize's exit hook is atexit's, which a worker never runs). The
        # write-back never refers to the wrapper; an inherited Finalize does nothing.
        mp_util.Finalize(self, close_at_exit, args=(writeback,), exitpriority=10)
        return writeback

    #: This process's write-back (None without a store): a forked child writes shards of its
    #: own and never seals the parent's pending features (the parent does).
    _writeback: ProcessLocal[WriteBack | None] = ProcessLocal(_new_writeback)

    # -- state --------------------------------------------------------------------------------
    def active(self) -> bool:
        """True when caching applies: enabled, and the encoder is frozen."""
        return self.enabled and is_frozen(self.encoder)

    def fingerprint(self) -> str:
        """The wrapped encoder's fingerprint (recomputed whenever the encoder changed)."""
        return self._watch.fingerprint()

    def _recipe_fp_under(self, autocast: torch.dtype | None) -> str:
        """The recipe fingerprint of a call run under ``autocast`` (its dtype; None: off).

        Ambient autocast changes every output (a bfloat16 result from a float32 encoder), so
        its dtype is part of the keys: before, rows encoded under ``torch.autocast`` were
        served to plain calls, in bfloat16, and the other way round."""
        if autocast is None:
            return self._recipe_fp  # the keys every call without autocast always had
        spec = {**self._recipe_spec, "autocast": str(autocast).removeprefix("torch.")}
        return recipe_fingerprint(spec)

    def cache_info(self) -> dict[str, CacheInfo | int]:
        """Counters: RAM and device tiers, store hits, rows encoded."""
        return {"ram": self._ram.info(), "device": self._dev.info(), **self.stats}

    def flush(self) -> None:
        """Seal the write-back shard now (also done at exit and when the wrapper is collected)."""
        if self._writeback is not None:
            self._writeback.seal()
        handed_over_sealed()  # and what dropped ones handed to the sealing thread

    # -- forward ------------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, *args: Any, ids: Sequence[Any] | None = None, **kwargs: Any
    ) -> Any:
        """``encoder(x)``, from the cache for the rows that were encoded before.

        Only ``x`` reaches the encoder, and ``ids`` is named (``ids=``): a second argument (an
        attention mask, lengths) would change the output without changing its key, so it is
        refused, never passed over or taken as the ids.

        Raises:
            ConfigError: another argument than ``x`` and ``ids``; ``x`` not a tensor; ``ids``
                one string, or not one entry per row, or an id of a type that has no exact
                content.
            EncodeError: the encoder's output has no per-row batch dimension, or rows of one
                call have outputs of different shapes.
        """
        refuse_call(x, args, kwargs, ids)
        why = self._stand_aside_reasons(x)
        if why != self._warned_for:
            # Said once per state, and again whenever what keeps it off changes: after .eval()
            # the parameters may still need freezing (issue 18 item 3).
            self._warned_for = why
            if why:
                warnings.warn(
                    f"CachedEncoder is running the encoder uncached: {'; '.join(why)}",
                    stacklevel=2,
                )
        if why:
            return self.encoder(x)
        batch = x.shape[0]
        if ids is not None and len(ids) != batch:
            raise ConfigError(f"CachedEncoder got {len(ids)} ids for a batch of {batch} rows")
        if not batch:  # no row to look up or keep: what the encoder gives for none
            with torch.no_grad():
                return self.encoder(x)
        enc_fp = self.fingerprint()
        if ids is not None:
            form = row_form(x)
            digests = [id_digest(i, form) for i in ids]
        else:
            digests = [row_digest(r) for r in x]
        recipe_fp = self._recipe_fp_under(autocast_now(module_device(self.encoder) or x.device))
        keys = [feature_key(enc_fp, recipe_fp, d) for d in digests]
        rows, todo = self._lookup(keys)
        out_device: torch.device | None = None
        if todo:
            sub = x[todo] if len(todo) < batch else x
            with torch.no_grad():
                parts = _split(self.encoder(sub), len(todo))
                if not self._rows_checked and len(todo) > 1:
                    refuse_dependent_rows(self.encoder, sub, parts)
                    self._rows_checked = True
            self._watch.ran()
            self.stats["encoded"] += len(todo)
            out_device = next(iter(parts.values())).device
            for r, j in enumerate(todo):
                row = {p: v[r] for p, v in parts.items()}
                if self._recipe is not None:  # stored as a build stores it (packed for int8)
                    row = stored_parts(row, self._recipe)
                    refuse_nonfinite(row, self._recipe, _row_name(ids, todo[r]))
                rows[j] = row
                self._remember(keys[j], row, enc_fp)
        if self._writeback is not None:
            self._writeback.seal_if_due()
        return self._assemble(rows, keys, out_device, x.device)

    def _lookup(self, keys: list[str]) -> tuple[list[dict[str, torch.Tensor] | None], list[int]]:
        """Each row's cached parts (device, RAM, then store), and the rows found nowhere."""
        rows: list[dict[str, torch.Tensor] | None] = [None] * len(keys)
        todo: list[int] = []
        for j, key in enumerate(keys):
            got = self._dev.get(key) if self._dev.max_bytes else None
            if got is not None:
                self.stats["hits_device"] += 1
            elif self._ram.max_bytes and (got := self._ram.get(key)) is not None:
                self.stats["hits_ram"] += 1
            else:
                todo.append(j)
            rows[j] = got
        if todo and self._layout is not None:
            found = self._from_store([keys[j] for j in todo])
            self.stats["hits_store"] += len(found)
            for j in todo:
                if keys[j] in found:
                    rows[j] = found[keys[j]]
                    if self._ram.max_bytes:
                        self._ram.put(keys[j], found[keys[j]])
            todo = [j for j in todo if rows[j] is None]
        if todo and self._writeback is not None:  # written back here or by another reader
            for j in todo:
                parts = pending_in_process(self._writeback, keys[j])
                rows[j] = dict(parts) if parts is not None else None
            self.stats["hits_pending"] += sum(rows[j] is not None for j in todo)
            todo = [j for j in todo if rows[j] is None]
        return rows, todo

    def _from_store(self, keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        """What the store holds of ``keys``; a feature whose shard is gone is a miss. On a
        shared filesystem the catalog is only read (a store with none yet holds nothing), and
        what other processes wrote back is found once ``featbake merge`` folded it in."""
        layout = self._layout
        if layout is None or (self._shared and not layout.catalog.exists()):
            return {}
        return self._store_reader().get_many(keys)

    def _stand_aside_reasons(self, x: torch.Tensor) -> tuple[str, ...]:
        """Everything that keeps caching off for this call, each with its fix (none: on)."""
        reasons = []
        if not self.enabled:
            reasons.append("enabled=False")
        # Under no_grad (a frozen teacher's usual call) no gradient could flow: held tensors
        # are not read. Dropout in one submodule makes every call differ.
        tree = tree_state(self.encoder, held=torch.is_grad_enabled())
        # named (a second walk) only where one may run in train mode
        training = training_submodule(self.encoder) if tree.training else None
        if training is not None:
            reasons.append(f"the encoder is in training mode: {training} (call .eval() on it)")
        if tree.trainable:
            reasons.append(
                f"{tree.trainable} encoder parameters require grad (call .requires_grad_(False) "
                "on it; .eval() alone does not)"
            )
        held = tree.held_trainable
        if held:
            reasons.append(
                f"the encoder holds tensors outside its parameters that require grad "
                f"({', '.join(held[:3])}), and cached rows would not carry their gradient "
                "(detach them, or register them as parameters and freeze them)"
            )
        if x.requires_grad and torch.is_grad_enabled():
            reasons.append(
                "the input requires grad, and cached rows would not carry its gradient (pass a "
                "detached input, or run under torch.no_grad())"
            )
        return tuple(reasons)

    def _assemble(
        self,
        rows: list[dict[str, torch.Tensor] | None],
        keys: list[str],
        out_device: torch.device | None,
        in_device: torch.device,
    ) -> Any:
        # Hits go where a miss's output would: the module's weights' device (a front-end of
        # buffers only too: encode/encoders.py's one rule), else the input's.
        device = out_device or (module_device(self.encoder) or in_device)
        names = list(rows[0])  # type: ignore[arg-type]
        # As stored: packed for int8/fp8, which the device tier keeps as they are. The tier
        # keeps each row as it reached the device, never a slice of the batch handed back (a
        # caller's in-place edit of its batch changed what later calls were served).
        moved = [{n: r[n].to(device, non_blocking=True) for n in names} for r in rows]  # type: ignore[index]
        refuse_uneven_rows(moved, names)
        stored = {name: torch.stack([m[name] for m in moved]) for name in names}
        if self._dev.max_bytes and device.type != "cpu":
            for j, key in enumerate(keys):
                if key not in self._dev:
                    self._dev.put(key, {n: own_storage(t) for n, t in moved[j].items()})
        served = self._served
        if served is None:
            return join_outputs(stored)
        return join_outputs({n: served.item(t) for n, t in stored.items()})  # after the copy

    def _remember(self, key: str, row: dict[str, torch.Tensor], enc_fp: str) -> None:
        host = {p: v.detach().to("cpu").clone() for p, v in row.items()}  # own storage
        if self._ram.max_bytes:
            self._ram.put(key, host)
        if self._writeback is not None:
            self._writeback.add(enc_fp, key, host)

    def _new_reader(self) -> FeatureReader:
        layout = self._layout
        assert layout is not None, "a store reader exists only with store=True"
        return FeatureReader(layout, read_only=self._shared)

    #: This process's reader of the store (connection, open shards), made on first read.
    _reader: ProcessLocal[FeatureReader] = ProcessLocal(_new_reader)

    def _store_reader(self) -> FeatureReader:
        return self._reader


__all__ = [
    "CachedEncoder",
    "ModuleWatch",
    "id_digest",
    "row_digest",
    "shared_watch",
]
