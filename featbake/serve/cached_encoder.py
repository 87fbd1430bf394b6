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
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from featbake.encode.encoders import is_frozen
from featbake.encode.identity import attribute_identity, is_plain, module_identity
from featbake.encode.outputs import is_tuple_parts, join_outputs, name_outputs, stored_parts
from featbake.errors import ConfigError, EncodeError
from featbake.keys import feature_key, module_fingerprint, recipe_fingerprint
from featbake.lru import ByteLRU, CacheInfo
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.recipe import Recipe
from featbake.serve.reads import Served, served_for
from featbake.serve.state import WriteBack, pending_in_process
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
#   bookkeeping: the digest is taken again after each run.
def row_digest(row: torch.Tensor) -> str:
    """SHA-256 of one input row's dtype, shape and bytes (a copy to the host off the CPU)."""
    t = row.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h = hashlib.sha256(f"row\0{t.dtype}\0{list(t.shape)}\0".encode())
    h.update(tensor_buffer(t))
    return h.hexdigest()


def id_digest(ident: Any) -> str:
    """SHA-256 of an id by its exact content and type (``"1"``, ``1`` and ``b"1"`` differ).

    Raises:
        ConfigError: the id is not a string, bytes, Python or numpy number, bool, None, path,
            tensor, numpy array (of numbers, strings or bytes), or a tuple or list of those.
    """
    h = hashlib.sha256(b"id\0")
    _feed(h, ident)
    return h.hexdigest()


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


def _weight_probe(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """A cheap digest of each tensor's bytes, one entry per tensor: CRC-32C on the CPU (the
    compiled kernel the store's reads use, about 4x zlib's CRC-32 on weights: ~8 ms for
    226 MB), a pair of byte sums on a device (one copy to the host for all of them), 0 for a
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
            b = t.contiguous().view(-1).view(torch.uint8)
            on_device.append(torch.stack([b.sum(dtype=torch.int64), b[::3].sum(dtype=torch.int64)]))
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


#: One submodule as a glance reads it: the submodule (weakly), what picks its public attribute
#: values from its ``__dict__`` (None: it has none) and whether that gives a tuple of them, and
#: the public plain values that are lists (edited in place, so read by value).
_Look = tuple[
    "weakref.ref[nn.Module]", Callable[[dict[str, Any]], Any] | None, bool, tuple[str, ...]
]


@dataclass(frozen=True, eq=False)
class GlancePlan:
    """What a :class:`Glance` of one module tree reads: each submodule and its public
    attribute names as the tree was when planned, and its tensors (parameters then buffers,
    each once, as ``parameters()`` and ``buffers()`` give them). All held weakly: a plan
    kept by a watch never keeps a replaced submodule's or tensor's memory alive."""

    looks: tuple[_Look, ...]
    tensors: tuple[weakref.ref[torch.Tensor], ...]

    def live_tensors(self) -> list[torch.Tensor] | None:
        """The planned tensors (None: one of them is gone, so the tree changed)."""
        tensors = [ref() for ref in self.tensors]
        return None if any(t is None for t in tensors) else tensors  # type: ignore[return-value]


def glance_plan(module: nn.Module) -> GlancePlan | None:
    """The plan of a glance at ``module`` as it is now (None for a tree holding a TorchScript
    module, whose dicts are views made anew on each read: it is always read exactly)."""
    looks = []
    for sub in module.modules():
        if isinstance(sub, torch.jit.ScriptModule):
            return None
        attrs = vars(sub)
        public = tuple(k for k in attrs if not k.startswith("_") and k != "training")
        listy = tuple(k for k in public if _edited_in_place(attrs[k]))
        pick = itemgetter(*public) if public else None
        looks.append((weakref.ref(sub), pick, len(public) > 1, listy))
    tensors = tuple(weakref.ref(t) for t in (*module.parameters(), *module.buffers()))
    return GlancePlan(tuple(looks), tensors)


def _edited_in_place(value: Any) -> bool:
    """A plain attribute value that can change while it stays the same object (a list)."""
    if isinstance(value, list):
        return is_plain(value)
    return isinstance(value, tuple) and any(map(_edited_in_place, value))


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
    tensors) and is no longer the same as any once one of those is gone."""

    plan: GlancePlan
    key: tuple[Any, ...]
    held: list[Any]
    gone: list[bool] = field(default_factory=lambda: [False])

    def same(self, other: Glance | None) -> bool:
        """Whether ``other`` (of the same plan) read the module as it is in this glance."""
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

        held = [weakref.ref(o, died) if type(o).__weakrefoffset__ else o for o in self.held]
        return Glance(self.plan, self.key, held, gone)


def take_glance(plan: GlancePlan) -> Glance | None:
    """A glance at the module now (None: a submodule or tensor planned, or a public attribute
    the plan names, is gone)."""
    held: list[Any] = []
    sizes: list[int] = []
    texts: list[str] = []
    add, extend = held.append, held.extend
    try:
        for ref, pick, many, listy in plan.looks:
            attrs = vars(ref())  # TypeError once it is gone
            dicts = (attrs["_modules"], attrs["_parameters"], attrs["_buffers"])
            sizes += (len(attrs), *map(len, dicts))
            if pick is not None:
                extend(pick(attrs)) if many else add(pick(attrs))
            texts += [repr(attrs[k]) for k in listy]
            for d in dicts:
                extend(d)
                extend(d.values())
    except (KeyError, TypeError):
        return None
    tensors = plan.live_tensors()
    if tensors is None:
        return None
    key = (
        tuple(sizes),
        tuple(map(id, held)),
        tuple([version_of(t) for t in tensors]),
        tuple([t.data_ptr() for t in tensors]),
        tuple(texts),
    )
    return Glance(plan, key, held)


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
        self._attrs = ""
        self._glanced: Glance | None = None  # the trusted state's glance
        self._untrusted: Glance | None = None  # a glance of a state found changed
        self._before = threading.local()  # per thread: the state as a run began, if trusted

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]

    def _versions(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((version_of(t), t.data_ptr()) for t in tensors)

    def _look(self) -> Glance | None:
        """A glance at the module now, by the plan of the trusted glance (None: none yet)."""
        glanced = self._glanced
        return None if glanced is None else take_glance(glanced.plan)

    def _trusted_tensors(self) -> list[torch.Tensor] | None:
        """The module's tensors where a glance now is the trusted one's (its versions,
        pointers and attributes as then), else None."""
        look = self._look()
        return look.plan.live_tensors() if look is not None and look.same(self._glanced) else None

    def _state(self, trusted: list[torch.Tensor] | None = None) -> tuple[Any, ...]:
        """(versions and pointers, weight probe, attributes) now; given the ``trusted``
        glance's tensors, the versions and attributes are the trusted ones, unread."""
        if trusted is not None:
            tensors, versions, attrs = trusted, self._seen[0], self._attrs
        else:
            tensors = self._tensors()
            versions, attrs = self._versions(tensors), attribute_identity(self.module)
        probe = _weight_probe(tensors) if self.check_weights else ()
        return versions, probe, attrs

    def _as_trusted(self, state: tuple[Any, ...]) -> bool:
        return self._fp is not None and state[:2] == self._seen[:2] and state[2] == self._attrs

    def _glance_again(self) -> None:
        """Glance at the module as it is trusted now, planned afresh (its tree may differ)."""
        plan = glance_plan(self.module)
        look = None if plan is None else take_glance(plan)
        self._glanced = None if look is None else look.kept()
        self._untrusted = None

    def fingerprint(self) -> str:
        """The module's fingerprint now (identity and every weight), recomputed on change."""
        trusted = self._trusted_tensors()
        state = self._state(trusted)
        if not self._as_trusted(state):
            identity = self.identity or module_identity(self.module)
            self._fp = module_fingerprint(self.module, identity)
            self._seen, self._attrs = state, state[2]
        if trusted is None:  # else the trusted glance still reads the state trusted now
            self._glance_again()
        assert self._fp is not None
        return self._fp

    def trust(self, fp: str) -> None:
        """Take ``fp`` as the module's fingerprint as it is now (the caller just computed it):
        :meth:`fingerprint` hashes the weights again only once the module changed."""
        tensors = self._tensors()
        probe = _weight_probe(tensors) if self.check_weights else ()
        self._attrs = attribute_identity(self.module)
        self._fp, self._seen = fp, (self._versions(tensors), probe, self._attrs)
        self._glance_again()

    def ran(self) -> None:
        """The module just ran: attribute changes it made itself are bookkeeping, not a change."""
        self._attrs = attribute_identity(self.module)
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
        look = self._look()
        if look is not None and self._fp is not None and look.same(self._glanced):
            kept: tuple[Glance | None, Any] | None = (look, self._seen[0])
        elif look is not None and look.same(self._untrusted):
            kept = None  # as it was when last found changed: still changed
        else:
            kept = self._began_changed(look)
        self._before.__dict__.setdefault("stack", []).append(kept)

    def _began_changed(self, look: Glance | None) -> tuple[Glance | None, Any] | None:
        """The exact check where the glance differs: the module may still be as trusted (an
        attribute set again to its value, a new plan); glanced again either way."""
        versions = self._versions(self._tensors())
        same = self._fp is not None and versions == self._seen[0]
        if same and attribute_identity(self.module) == self._attrs:
            self._glance_again()
            return self._glanced, versions
        if look is not None and self._glanced is not None and look.plan is self._glanced.plan:
            self._untrusted = look.kept()
        return None

    def run_ended(self) -> None:
        """A forward ended: a module trusted as it began is trusted as it is now; where the
        glance did not move, nothing is read; the weights are read again only where the run
        moved a version or pointer (a buffer it replaced)."""
        stack = self._before.__dict__.get("stack")
        kept = stack.pop() if stack else None
        if kept is None:
            return
        began, versions_before = kept
        look = None if began is None else take_glance(began.plan)
        if look is not None and look.same(began):
            return  # the run changed nothing the watch reads
        tensors = self._tensors()
        versions = self._versions(tensors)
        probe = self._probe_after(tensors, versions, versions_before)
        self._attrs = attribute_identity(self.module)
        self._seen = (versions, probe, self._attrs)
        self._glance_again()

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
        del state["_before"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._before = threading.local()


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
    if len(kept) != len(before):
        return _weight_probe(list(tensors))
    olds: dict[Any, list[int]] = {}
    for i, was in enumerate(before):
        olds.setdefault(was, []).append(i)
    probe: list[Any] = [None] * len(tensors)
    fresh = []
    for j, now in enumerate(versions):
        same = olds.get(now)
        if same:
            probe[j] = kept[same.pop(0)]
        else:
            fresh.append(j)
    for j, entry in zip(fresh, _weight_probe([tensors[j] for j in fresh]), strict=True):
        probe[j] = entry
    return tuple(probe)


class _RunHook:
    """A forward (pre-)hook telling a :class:`ModuleWatch` that its module's run began or
    ended; it keeps the watch weakly, and a copy of the module (pickled, deep-copied) gets a
    hook that does nothing: the copy is not the module watched."""

    def __init__(self, watch: weakref.ref[ModuleWatch], began: bool) -> None:
        self.watch, self.began = watch, began

    # Run as it is under torch.compile: dynamo tracing it would break the graph at each
    # tensor it reads (a CRC kernel it cannot trace), to the same end.
    @torch.compiler.disable
    def __call__(self, module: nn.Module, *args: Any) -> None:
        watch = self.watch()
        if watch is not None:
            watch.run_began() if self.began else watch.run_ended()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_no_hook, ())


def _no_hook() -> Callable[..., None]:
    return _ignore_run


def _ignore_run(*args: Any) -> None:
    return None


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


def _split(result: Any, batch: int) -> dict[str, torch.Tensor]:
    """The encoder's per-row outputs by part name (the store's one naming rule)."""
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
    tensor, keyed by its exact content: the caller promises that an id always names the same
    input), else from each row's
    dtype, shape and bytes (which costs a copy to the host for a CUDA input). Results equal
    calling the encoder directly, up to the batch-size-dependent rounding of its kernels, since
    misses are encoded as a smaller batch.

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
            raise ConfigError(f"CachedEncoder wraps an nn.Module, got {type(encoder).__name__}")
        self.encoder = encoder
        self.enabled = enabled
        self._ram: ByteLRU[str, Any] = ByteLRU(parse_bytes(ram_cache))
        self._dev: ByteLRU[str, Any] = ByteLRU(parse_bytes(device_cache))
        self._recipe, self._served = stored_dtype(dtype, serve_dtype)
        spec = CACHED_ENCODER_RECIPE if dtype is None else {**CACHED_ENCODER_RECIPE, "dtype": dtype}
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
        weakref.finalize(self, writeback.close)  # the write-back never refers to the wrapper
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

    def cache_info(self) -> dict[str, CacheInfo | int]:
        """Counters: RAM and device tiers, store hits, rows encoded."""
        return {"ram": self._ram.info(), "device": self._dev.info(), **self.stats}

    def flush(self) -> None:
        """Seal the write-back shard now (also done at exit and when the wrapper is collected)."""
        if self._writeback is not None:
            self._writeback.seal()

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, ids: Sequence[Any] | None = None) -> Any:
        """``encoder(x)``, from the cache for the rows that were encoded before.

        Raises:
            ConfigError: ``ids`` does not have one entry per row, or an id of a type that has
                no exact content.
            EncodeError: the encoder's output has no per-row batch dimension.
        """
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
        digests = [id_digest(i) for i in ids] if ids is not None else [row_digest(r) for r in x]
        keys = [feature_key(enc_fp, self._recipe_fp, d) for d in digests]
        rows, todo = self._lookup(keys)
        out_device: torch.device | None = None
        if todo:
            sub = x[todo] if len(todo) < batch else x
            with torch.no_grad():
                parts = _split(self.encoder(sub), len(todo))
            self._watch.ran()
            self.stats["encoded"] += len(todo)
            out_device = next(iter(parts.values())).device
            for r, j in enumerate(todo):
                row = {p: v[r] for p, v in parts.items()}
                if self._recipe is not None:  # stored as a build stores it (packed for int8)
                    row = stored_parts(row, self._recipe)
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
        if self.encoder.training:
            reasons.append("the encoder is in training mode (call .eval() on it)")
        trainable = sum(p.requires_grad for p in self.encoder.parameters())
        if trainable:
            reasons.append(
                f"{trainable} encoder parameters require grad (call .requires_grad_(False) "
                "on it; .eval() alone does not)"
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
        device = out_device or (self._param_device() or in_device)
        names = list(rows[0])  # type: ignore[arg-type]
        # As stored: packed for int8/fp8, which the device tier keeps as they are. The tier
        # keeps each row as it reached the device, never a slice of the batch handed back (a
        # caller's in-place edit of its batch changed what later calls were served).
        moved = [{n: r[n].to(device, non_blocking=True) for n in names} for r in rows]  # type: ignore[index]
        stored = {name: torch.stack([m[name] for m in moved]) for name in names}
        if self._dev.max_bytes and device.type != "cpu":
            for j, key in enumerate(keys):
                if key not in self._dev:
                    self._dev.put(key, {n: own_storage(t) for n, t in moved[j].items()})
        served = self._served
        if served is None:
            return join_outputs(stored)
        return join_outputs({n: served.item(t) for n, t in stored.items()})  # after the copy

    def _param_device(self) -> torch.device | None:
        p = next(iter(self.encoder.parameters()), None)
        return p.device if p is not None else None

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
