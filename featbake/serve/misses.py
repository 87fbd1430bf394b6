"""What a refused miss tells the user: which option differs from what the store holds (pure).

A ``CacheMiss`` used to say "not in the store for this encoder and recipe" and suggest a build
without ``--dtype`` or ``--cache``: a dataset asking ``dtype="float16"`` of a float32 bake was
left to guess. The store's roots say how each folder was built; comparing their recipes with
the dataset's names the field, and the suggested command carries every option that matters.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import sqlite3
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import Any

import torch

import featbake.device as dev
from featbake.encode.encoders import (
    MODULE,
    LoadedEncoder,
    from_module,
    meta_tensor,
    module_device,
    refuse_held_tensors,
    refuse_meta,
    training_submodule,
)
from featbake.encode.fingerprints import (
    cached_file_encoder_fp,
    encoder_fingerprint,
    file_fingerprint,
)
from featbake.encode.hf import is_hf_folder
from featbake.encode.identity import (
    foreign_global_hooks,
    forward_globals,
    forward_hooks,
    held_values,
    module_identity,
)
from featbake.encode.inputs import DigestView
from featbake.encode.loaders import is_import_path, load_encoder
from featbake.encode.outputs import encode_batch, refuse_nonfinite, stored_parts
from featbake.encode.sources import CheckingSource, Source, load_unchanged
from featbake.errors import CacheMiss, EncoderLoadError, FeatbakeError, SourceError
from featbake.image_recipe import image_options
from featbake.keys import feature_key, sha256_hex
from featbake.recipe import Recipe
from featbake.serve.cached_encoder import ModuleWatch, shared_watch
from featbake.serve.index import Index
from featbake.serve.reads import Reads
from featbake.serve.state import ProcessState, kept_copy, owned_parts, pending_in_process
from featbake.store.byteplace import bytes_at
from featbake.store.catalog import Catalog, ServingStore
from featbake.store.features import Parts
from featbake.store.fragment_catalog import open_serving_catalog
from featbake.store.hash_cache import FileStat, HashEntry
from featbake.store.layout import Layout
from featbake.store.open import describe
from featbake.store.shard import Leases, SealedShard

# == miss_advice ===================================================================================
#: Recipe field -> the `featbake build` option that sets it (mono is --mono/--no-mono).
CLI_OPTION = {
    "source": "--source",
    "sample_rate": "--sample-rate",
    "max_seconds": "--max-seconds",
    "output": "--output",
    "dtype": "--dtype",
    "precision": "--precision",
    "layers": "--layers",
}


#: How a build stores what a miss refuses (:func:`refuse_nonfinite`), served as stored after.
NONFINITE_BUILD = "; `featbake build --allow-nonfinite` stores them anyway"


@dataclass(frozen=True)
class StoredBuild:
    """How the store built a folder: the encoder as named and its recipe (from its root)."""

    encoder_label: str
    recipe: Mapping[str, Any]


def recipe_differences(asked: Mapping[str, Any], stored: Mapping[str, Any]) -> list[str]:
    """``field=stored (asked value)`` for each recipe field that differs, by field name.

    Example:
        >>> recipe_differences({"dtype": "float16"}, {"dtype": "float32"})
        ["dtype='float32' in the store, 'float16' asked"]
    """
    fields = sorted((set(asked) | set(stored)) - {"version"})
    cropped = [r.get("max_seconds") is not None for r in (asked, stored)]
    said = []
    for f in fields:
        if asked.get(f) == stored.get(f):
            continue
        if f in OWN_VERSIONS and any(cropped):
            # Both crop: the store's is an older featbake's; one does: max_seconds says it.
            if all(cropped):
                said.append(OWN_VERSIONS[f])
            continue
        said.append(f"{f}={stored.get(f)!r} in the store, {asked.get(f)!r} asked")
    return said


#: Recipe fields that are featbake's own versions of a step, not options a user passes: a
#: difference is said as what it is (``crop=None in the store, 2 asked`` named an option no
#: one can pass).
OWN_VERSIONS = {
    "crop": "the store's --max-seconds crop was made by an older featbake (64 samples of the "
    "resampler's context; its last samples differ): build it again"
}


def build_options(recipe: Mapping[str, Any]) -> list[str]:
    """The `featbake build` options that reproduce ``recipe`` (defaults left out).

    Example:
        >>> build_options({**Recipe().as_dict(), "dtype": "float16", "mono": False})
        ['--dtype float16', '--no-mono']
    """
    default = Recipe().as_dict()
    out = []
    for field, option in CLI_OPTION.items():
        value = recipe.get(field)
        if value is None or value == default.get(field):
            continue
        shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        out.append(f"{option} {shown}")
    if recipe.get("mono") is False:
        out.append("--no-mono")
    image = recipe.get("image")
    return out + text_options(recipe.get("text")) + (image_options(image) if image else [])


def text_options(text: Mapping[str, Any] | None) -> list[str]:
    """The `featbake build` text options that reproduce a text recipe's tokenizer options
    (``--max-tokens`` always: its default is the tokenizer's, which the recipe does not name).

    Example:
        >>> text_options({"max_length": 77, "truncate": False, "lowercase": True})
        ['--max-tokens 77', '--no-truncate', '--lowercase']
    """
    if not text:
        return []
    out = [f"--max-tokens {text['max_length']}"] if text.get("max_length") else []
    # (recipe field, its default, the option turning it on, the option turning it off): each
    # option spelled whole, so tests/cli/test_options.py checks that the CLI takes it.
    flags = (
        ("truncate", True, "--truncate", "--no-truncate"),
        ("lowercase", False, "--lowercase", "--no-lowercase"),
        ("special_tokens", True, "--special-tokens", "--no-special-tokens"),
    )
    for name, default, on, off in flags:
        if text.get(name, default) != default:
            out.append(on if text[name] else off)
    return out


def miss_message(
    path: str,
    store: str,
    encoder: str,
    data: str,
    asked: Mapping[str, Any],
    builds: Sequence[StoredBuild],
    column: str | None = None,
    loading: Sequence[str] = (),
) -> str:
    """The CacheMiss text: what is missing, what the store holds instead, and the command
    (with ``--column`` when the data is a manifest's or table's column, and ``loading``: the
    options the encoder is loaded with, ``--weights`` and ``--trust-pickle``), which builds
    what the dataset asks for: a command that left them out failed, or built another recipe
    and the dataset missed again."""
    head = f"{path} is not in the store {store} for this encoder and recipe"
    same_encoder = [b for b in builds if b.encoder_label == encoder]
    if same_encoder:
        diffs = recipe_differences(flat_recipe(asked), flat_recipe(same_encoder[0].recipe))
        if diffs:
            head += f"; the store built {data} with other options: {'; '.join(diffs)}"
    elif builds:
        others = ", ".join(sorted({b.encoder_label for b in builds}))
        head += f"; the store built {data} with another encoder ({others}), not {encoder}"
    named = ["--column", column] if column else []
    options = [opt for option in build_options(asked) for opt in option.split(" ", 1)]
    command = shlex.join(
        ["featbake", "build", "--encoder", encoder, *loading, "--data", data, *named, "--cache",
         store, *options]
    )  # fmt: skip
    image = asked.get("image")
    alternative = ""
    if isinstance(image, Mapping) and image.get("composite") is False:  # no option gives it
        alternative = (
            " (where the encoder's processor composites transparency, which this recipe leaves "
            "as saved: `featbake.build(..., recipe=dataset.recipe)`)"
        )
    return (
        f"{head}. Run `{command}`{alternative}, pass the store's options to the dataset, or use "
        "on_miss='encode'"
    )


def flat_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """``recipe`` with its nested steps flattened: ``{"image": {"crop": ...}}`` gives
    ``image.crop``, so a difference names the one step that differs.

    Example:
        >>> flat_recipe({"dtype": "float32", "image": {"crop": [224, 224]}})
        {'dtype': 'float32', 'image.crop': [224, 224]}
    """
    out: dict[str, Any] = {}
    for field, value in recipe.items():
        if isinstance(value, Mapping):
            out.update({f"{field}.{k}": v for k, v in value.items() if k != "version"})
        else:
            out[field] = value
    return out


def copied_not_encoded(asked: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    """True when ``asked`` differs from ``stored`` only by naming one ``output`` of a
    whole-output build: its misses are copied from the store, not encoded (serve/misses.py)."""
    differs = {f for f in set(asked) | set(stored) if asked.get(f) != stored.get(f)}
    return differs == {"output"} and stored.get("output") is None


def live_encoding_warning(
    data: str,
    missing: int,
    total: int,
    encoder: str,
    asked: Mapping[str, Any],
    builds: Sequence[StoredBuild],
) -> str | None:
    """The warning for a dataset about to encode ``missing`` items live while the store holds
    the same data from the same encoder under other options (issue 32 item 2: a recipe that
    differed from the build's encoded everything again, in silence); None when there is no
    such build, or when its misses are copied from it instead.

    Example:
        >>> built = StoredBuild("enc", {"dtype": "float32", "image": {"crop": [224, 224]}})
        >>> live_encoding_warning(
        ...     "imgs", 2, 2, "enc", {"dtype": "float32", "image": {"crop": [196, 196]}}, [built]
        ... )  # doctest: +ELLIPSIS
        "featbake: 2 of 2 items of imgs ... other options: image.crop=[224, 224] in the store..."
    """
    same = [b for b in builds if b.encoder_label == encoder and dict(b.recipe) != dict(asked)]
    if not missing or not same or any(copied_not_encoded(asked, b.recipe) for b in same):
        return None  # one whole-output build among them: its parts are copied, not encoded
    # The build nearest the asked recipe names what to change (not whichever was listed first).
    diffs = min(
        (recipe_differences(flat_recipe(asked), flat_recipe(b.recipe)) for b in same), key=len
    )
    return (
        f"featbake: {missing} of {total} items of {data} are not in the store for this recipe "
        f"and will be encoded live on first read, although the store built {data} with this "
        f"encoder under other options: {'; '.join(diffs)}. Pass the store's options to the "
        "dataset to read what it holds, or build this recipe once with `featbake build`"
    )


# == derived =======================================================================================
# Misses served from a whole-output root: a part copied, not encoded (issue 32 item 2).
#
# A store built without ``--output`` holds every part of each input's output (``pooled``,
# ``tokens``, ...). A dataset asking ``Recipe(output="pooled")`` of it used to miss on every item
# and encode it again, in silence: ``output`` is part of the key. The part is the same tensor,
# though (the same encoder on the same bytes with the same preprocessing and dtype), so a miss
# first looks up the input's *whole-output key* and, when the store holds the part there, serves
# and writes back a copy of it; ``featbake build --output`` does the same
# (:mod:`featbake.bake.derive`). The input's digest comes from the hash cache (its stat
# unchanged) or, when that does not say, from hashing the file: its bytes, never its decoding.
def whole_output_fingerprint(recipe: Recipe) -> str | None:
    """The fingerprint of ``recipe`` without ``output``; None when it stores the whole output.
    An int8 or fp8 part is copied too: each part is quantised on its own, row by row, so the
    whole output's part is the packed tensor this recipe stores (``featbake build --output``
    copies it as well, :func:`featbake.bake.derive.source_recipes`)."""
    if recipe.output is None:
        return None
    return recipe.replace(output=None).fingerprint()


def current_digest(cached: Mapping[str, HashEntry], path: str) -> str | None:
    """The SHA-256 of ``path`` now: from the hash cache while its stat is unchanged, else read
    (None when it cannot be read, or changes while it is)."""
    try:
        now = FileStat.of(path)
        entry = cached.get(path)
        if entry is not None and entry.stat == now:
            return entry.sha256
        sha = file_fingerprint(path)
        return sha if FileStat.of(path) == now else None
    except OSError:
        return None


def current_digests(st: ProcessState, index: Index, paths: Sequence[str]) -> dict[str, str]:
    """path -> its digest now, for the ``paths`` that can be read: through the dataset's inputs
    (a tar member's, a table cell's and a segment's digest are not their path's file's), the
    hash cache consulted and nothing recorded; a list of files by :func:`current_digest`."""
    if index.inputs is None:
        cached = st.catalog.cached_hashes(paths)
        found = {p: current_digest(cached, p) for p in paths}
        return {p: d for p, d in found.items() if d is not None}
    try:
        digests, _ = index.inputs.hash(DigestView(st.catalog, {}), list(paths))
    except FeatbakeError:
        return {}  # unreadable now: such items are encoded like any miss
    return digests


def copied_parts(
    st: ProcessState,
    reads: Reads,
    index: Index,
    fps: tuple[str, str],
    recipe: Recipe,
    idx: Sequence[int],
) -> dict[int, Parts]:
    """item -> ``{"": part}`` for each of ``idx`` whose part the store holds under its
    whole-output key; ``fps`` is (encoder, recipe) fingerprint. Items whose file changed since
    the dataset was made (its digest no longer gives the item's key) are left to be encoded."""
    whole_fp = whole_output_fingerprint(recipe)
    if whole_fp is None or not idx:
        return {}
    part = str(recipe.output)
    paths = [index.path(i) for i in idx]
    digests = current_digests(st, index, paths)
    out: dict[int, Parts] = {}
    for i, path in zip(idx, paths, strict=True):
        sha = digests.get(path)
        if sha is None or feature_key(fps[0], fps[1], sha) != index.key(i):
            continue
        whole = reads.locate(st, feature_key(fps[0], whole_fp, sha))
        locs = [loc for loc in whole if loc.part == part]
        if not locs:
            continue
        try:
            with Leases() as held:
                value = reads.read_locations(st, locs, held, not st.check_never)
        except FeatbakeError:
            continue  # gone since, or damaged: encoded like any miss
        out[i] = {"": value[part]}
    return out


# == live ==========================================================================================
# Live encoding on a miss: the encoder (fingerprinted once, loaded lazily) and the inputs.
#
# A file encoder is loaded only when the first miss happens in a process (or once, in the
# process that makes the dataset, to fingerprint it when the store has never seen this file). An
# in-process module runs where it lives.
@dataclass
class LiveEncoder:
    """The dataset's encoder: how it was given, its fingerprint, and (lazily) the loaded one.

    ``spec`` is the file or import path, or None for an in-process module (``loaded`` then).
    """

    layout: Layout
    spec: str | None
    weights: str | None
    trust_pickle: bool
    device: str
    layers: tuple[int, ...] | str | None = None
    fingerprint: str = ""
    label: str = ""
    loaded: LoadedEncoder | None = None
    shared: bool = False  # the store is on a shared filesystem: never write its catalog
    read_only: bool = False  # never write the store (a spot check): fingerprints not cached
    watch: ModuleWatch | None = None  # an in-process module's: notices it changed since
    moved: bool = False  # the module had changed when this copy was pickled
    dtypes: tuple[str, ...] = ()  # an in-process module's weight dtypes when it was given
    hooks: tuple[Any, ...] = ()  # an in-process module's forward hooks when given (hooks_now)
    changed: str = ""  # what changed, told where this copy was pickled (what_changed)
    keyed: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # the hooks' readings keyed
    elsewhere: str = ""  # what this copy's hooks read otherwise than the keys (a spawned worker)

    def loading_options(self) -> list[str]:
        """The `featbake build` arguments that load this encoder as the dataset does."""
        out = ["--weights", os.path.abspath(self.weights)] if self.weights else []
        return out + (["--trust-pickle"] if self.trust_pickle else [])

    def identify(self, encoder: Any, catalog: ServingStore) -> None:
        """Set :attr:`fingerprint` and :attr:`label`, loading the encoder only if it must.

        Raises:
            EncoderLoadError: the encoder file is missing or cannot be loaded, or a module
                has its weights on the meta device.
        """
        if isinstance(encoder, LoadedEncoder):
            refuse_meta(encoder.label, encoder.module, "")  # before it is hashed
            refuse_held_tensors(encoder.label, encoder.module)
            self.loaded, self.label = encoder, encoder.label
            self.fingerprint = encoder_fingerprint(encoder, catalog, self.weights)
            self.watch = watched(encoder, self.fingerprint)
            self.dtypes = weight_dtypes(encoder.module)
            self.hooks = hooks_now(encoder.module)
            self.keyed = hook_readings(self.hooks)
            return
        if isinstance(encoder, torch.nn.Module):
            refuse_meta(type(encoder).__name__, encoder, "")
            refuse_held_tensors(type(encoder).__name__, encoder)
            self.loaded = from_module(encoder, device=None)
            self.fingerprint, self.label = self.loaded.fingerprint, self.loaded.label
            self.watch = watched(self.loaded, self.fingerprint)
            self.dtypes = weight_dtypes(encoder)
            self.hooks = hooks_now(encoder)
            self.keyed = hook_readings(self.hooks)
            return
        spec = self.spec = os.fspath(encoder)
        self.label = spec  # an import path: the architecture lives in code, only loading it tells
        if not is_import_path(spec):
            if not os.path.isfile(spec) and not is_hf_folder(spec):
                raise EncoderLoadError(
                    f"encoder {spec} not found; give the TorchScript (.pt) or torch.export "
                    "(.pt2) file or the import path you passed to `featbake build --encoder`"
                )
            self.label = str(Path(spec).resolve())
            fp = cached_file_encoder_fp(catalog, spec) if self.weights is None else None
            if fp is not None:
                self.fingerprint = fp
                return
        enc = self.load(torch.device("cpu"))
        catalog.record_encoder(enc.fingerprint, enc.label, enc.kind)
        self.loaded, self.fingerprint = enc, enc.fingerprint  # reused for misses here

    def load(self, device: torch.device) -> LoadedEncoder:
        """Load the encoder from its file or import path onto ``device``."""
        assert self.spec is not None
        enc = load_encoder(
            self.spec,
            weights=self.weights,
            device=device,
            trust_pickle=self.trust_pickle,
            layers=self.layers,
        )
        catalog = (
            Catalog(self.layout, read_only=True)
            if self.read_only
            else open_serving_catalog(self.layout, shared=self.shared)
        )
        try:
            encoder_fingerprint(enc, catalog, self.weights)
        finally:
            catalog.close()
        return enc

    def for_this_process(self) -> LoadedEncoder:
        """The encoder to run misses with here (loaded on first use in this process).

        Raises:
            EncoderLoadError: it cannot run here, or it changed since the dataset was made.
        """
        enc = self.loaded
        if self.spec is None:  # an in-process module: it runs where it lives
            assert enc is not None
            self.refuse_changed()
            enc = self.on_its_device(enc)
            if enc.device.type == "cuda" and not dev.cuda_usable_here():
                raise EncoderLoadError(
                    "a miss must be encoded in a DataLoader worker forked after CUDA started, "
                    "where CUDA cannot run, but the encoder module lives on the GPU; pass the "
                    "encoder as a file, or use DataLoader(..., multiprocessing_context='spawn')"
                )
        else:
            device = dev.resolve_device(self.device)
            if device.type == "cuda" and not dev.cuda_usable_here():
                device = torch.device("cpu")  # forked after CUDA started: CUDA cannot start here
            if enc is None or enc.device != device:
                enc = self.load(device)
        if enc.fingerprint != self.fingerprint:
            raise EncoderLoadError(
                f"the encoder {self.label} changed since this dataset was created "
                f"(fingerprint {enc.fingerprint[:12]}, expected {self.fingerprint[:12]}); "
                "create the dataset again so its keys match the encoder"
            )
        return enc

    def refuse_changed(self) -> None:
        """Raise if the in-process module changed since the dataset's keys were made from it.

        Raises:
            EncoderLoadError: it is in train mode, or its weights or attributes changed
                (checked before each encoding of misses: a miss encoded with it would be
                stored under the old keys).
        """
        # None where nothing was handed in (a file's encoder, loaded in this worker by it)
        module = None if self.loaded is None else self.loaded.module
        training = training_submodule(module)
        if training is not None:
            raise EncoderLoadError(
                f"the encoder module {self.label} is in train mode ({training}), and a miss "
                "encoded so (dropout, batch statistics) would be stored under the keys of its "
                "eval mode; call .eval() on it, or give the dataset a copy of it"
            )
        refuse_meta(self.label, module, " (moved there after this dataset was created)")
        if self.elsewhere:
            raise EncoderLoadError(self.elsewhere)
        if self.moved or self._changed_since(module):
            raise EncoderLoadError(
                f"the encoder module {self.label} changed since this dataset was created "
                f"({self.what_changed(module)}), and a miss encoded with it would be stored "
                "under the keys of the module as it was; create the dataset again with the "
                "module as it is now"
            )

    def _changed_since(self, module: Any) -> bool:
        """Whether the watch finds the module changed since its keys were made, or (where it
        had hooks) what a hook holds differs read exactly: a global module a hook runs whose
        weights were edited behind their version counters (``weight.data.mul_``), which the
        watch's reads at each forward trust (:func:`~featbake.encode.identity.held_values`)."""
        if self.watch is not None and self.watch.fingerprint() != self.fingerprint:
            return True
        if not self.hooks:
            return False
        exactly = [held for *_, held in hooks_now(module, exact=True)]
        return exactly != [held for *_, held in self.hooks]

    def what_changed(self, module: Any) -> str:
        """What a changed module's message names: its forward hooks where one was added,
        removed or replaced, or what one holds changed (an observer hook too: whether a hook
        changes outputs cannot be told; the hook objects compared, no file read), its
        weights' dtypes where they moved (``.half()``, ``.to(torch.float64)``: move it back to
        keep the keys), else what may. A copy pickled says what its original found (there, a
        hook of the script run is ``__mp_main__``'s: compared here, any would differ)."""
        if self.changed:
            return self.changed
        unkeyed = self.watch.unkeyed_change if self.watch is not None else ""
        if unkeyed:
            return UNKEYED_CHANGES[unkeyed]
        hooks = hooks_now(module) if module is not None else self.hooks
        if not same_hooks(hooks, self.hooks):
            differs = hooks_differ(hook_readings(self.hooks), hook_readings(hooks))
            if differs.endswith("that the module's forward reads differs here"):
                return (
                    f"{differs.removesuffix(' differs here')} changed since, and the keys "
                    "read it; set it before making the dataset"
                )
            return (
                "a forward hook was added, removed or replaced since, or what it holds "
                "changed, and a hook may change what it returns; register hooks before making "
                "the dataset, or remove it"
            )
        now = weight_dtypes(module)
        if module is None or not self.dtypes or now == self.dtypes:
            return "its weights or attributes"
        said = f"its weights are {', '.join(now)} now, {', '.join(self.dtypes)} then"
        if len(self.dtypes) == 1:  # one dtype then: one call brings the module back
            said += f"; .to({self.dtypes[0]}) brings back the module its keys were made from"
        return said

    def on_its_device(self, enc: LoadedEncoder) -> LoadedEncoder:
        """The in-process encoder on the device its weights are on now: a module moved after
        the dataset was made (``.cuda()``, ``.to(device)``) encodes its misses there, its
        inputs sent there too, where they met weights on another device. Its keys stand: a
        key names no device (:mod:`featbake.keys`), as a build on a GPU and a read on a CPU
        share theirs, the two agreeing up to kernels' rounding."""
        device = module_device(enc.module)
        if device is None or device == enc.device:
            return enc
        self.loaded = replace(enc, device=device)
        return self.loaded

    def ran(self) -> None:
        """The encoder just encoded misses: what an in-process module changed itself while
        it ran (a call counter, a cache buffer it replaced) is its bookkeeping, not a change.
        A module taking hooks is followed through every run, whoever calls it
        (:func:`shared_watch`); one that takes none (TorchScript) was checked just before
        (:meth:`refuse_changed`) and is trusted as it is now."""
        if self.watch is not None and not self.watch.follows_runs:
            self.watch.trust(self.fingerprint)

    def __getstate__(self) -> dict[str, Any]:
        # Not a ProcessLocal: a loaded module stays valid in a forked worker, which runs its
        # misses with it and loads nothing (a CUDA one is reloaded by for_this_process); only
        # a pickled copy drops a file's encoder (too big to pickle) and reloads it on a miss.
        state = self.__dict__.copy()
        if self.spec is not None:
            state["loaded"] = None  # reloaded from the file on the first miss
        if self.watch is not None:
            # Checked here and trusted anew where it lands: there the module's identity may
            # read otherwise (a class of the script run is __mp_main__'s in a spawned worker).
            # A module on the meta device has no values to hash: its copy refuses a miss
            # (refuse_changed) and serves what is stored.
            state["watch"] = None
            state["moved"] = self.moved or (
                meta_tensor(self.watch.module) is None
                and self.watch.fingerprint() != self.fingerprint
            )
            if state["moved"]:
                state["changed"] = self.what_changed(self.watch.module)
        # Objects of this process (a lambda does not pickle); what they read when the keys were
        # made travels as ``keyed``, compared where the copy lands (a spawned worker imports
        # the script anew: an adapter main() loaded is not loaded there).
        state["hooks"] = ()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.loaded is not None and self.spec is None and not self.moved:
            self.watch = watched(self.loaded, self.fingerprint)
            # The copy's hooks, as it is trusted; read exactly where they hold anything.
            self.hooks = hooks_now(self.loaded.module, exact=bool(self.keyed))
            differs = hooks_differ(self.keyed, hook_readings(self.hooks))
            if differs:
                self.elsewhere = elsewhere_message(self.label, differs)


def watched(enc: LoadedEncoder, fingerprint: str) -> ModuleWatch | None:
    """What notices that an encoder module given to a dataset (an ``nn.Module``, or a
    ``LoadedEncoder`` of one or of a file) changed after its keys were made from
    ``fingerprint`` (weights updated in place, an attribute set), so that a miss is not encoded
    with it and stored under those keys: the module's one watch, shared with every other
    dataset given it. None for a module that is no ``nn.Module``. A file's encoder keeps its
    own identity (its file's code), an in-process module's is taken again on each change."""
    module = enc.module
    if not isinstance(module, torch.nn.Module):
        return None
    own = enc.kind == MODULE and enc.identity == module_identity(module)
    watch = shared_watch(module, None if own else enc.identity)
    watch.trust(fingerprint)
    return watch


#: What a change of what no key reads (a watch's ``unkeyed_change``) is told as.
UNKEYED_CHANGES = {
    "global hooks": (
        "a global forward hook (register_module_forward_pre_hook or "
        "register_module_forward_hook) was added or removed since, and it may change what the "
        "module returns; register it before making the dataset, or remove it"
    ),
    "attributes": (
        "a tensor attribute that is no parameter or buffer, or forward set on the instance, "
        "changed since the keys were made, and the watch does not key them anew; register "
        "such a tensor as a buffer, or make the dataset after setting them"
    ),
}


def hooks_now(
    module: Any, exact: bool = False
) -> tuple[tuple[str, str, Any, tuple[str, ...]], ...]:
    """A module's forward hooks now, then torch's process-wide ones that run on its forward
    (:func:`~featbake.encode.identity.foreign_global_hooks`, as ``"<global>"``: its key reads
    them too), each with what it holds (:func:`held_values`; ``exact``: a global module a hook
    reads hashed anew): what :func:`same_hooks` compares with those it had when given to the
    dataset, and what the check before each batch of misses reads exactly."""
    if not isinstance(module, torch.nn.Module):
        return ()
    own = list(forward_hooks(module))
    own += [("<global>", "", h) for h in foreign_global_hooks()]
    rows = tuple((n, k, h, tuple(held_values(h, exact=exact))) for n, k, h in own)
    read = forward_globals(module, exact=exact)
    return (*rows, (FORWARD, "", type(module), (read,))) if read else rows


#: Where a :func:`hooks_now` reading names the globals the module's own forward reads
#: (:func:`~featbake.encode.identity.forward_globals`), read and compared as a hook's are.
FORWARD = "<forward>"


def hook_readings(hooks: Sequence[Any]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """A :func:`hooks_now` reading without the hook objects (where each hook is, what it
    holds): what a pickled copy carries of the hooks its keys were made with."""
    return tuple((name, kind, held) for name, kind, _, held in hooks)


def hooks_differ(then: Sequence[Any], now: Sequence[Any]) -> str:
    """What differs between two :func:`hook_readings` (those the keys were made with and
    those of a copy in another process), named; ``""`` where nothing does.

    Example:
        >>> then = (("", "_forward_hooks", ("function(c,global ADAPTER=module(1))",)),)
        >>> hooks_differ(then, (("", "_forward_hooks", ("function(c,global ADAPTER=module(2))",)),))
        'the global ADAPTER that the hook on the module reads differs here'
    """
    if [r[:2] for r in then] != [r[:2] for r in now]:
        return (
            "the forward hooks that run differ here (a process-wide hook registered when the "
            "dataset was made is not registered here, or one registered here was not then)"
        )
    for (name, _, held_then), (_, _, held_now) in zip(then, now, strict=True):
        if held_then != held_now:
            names = differing_globals(",".join(held_then), ",".join(held_now))
            where = _reader(name)
            if not names:
                return f"what {where} holds differs here"
            return f"the global {', '.join(names)} that {where} reads differs here"
    return ""


def _reader(name: str) -> str:
    """What reads a :func:`hooks_now` row's values, as a message names it."""
    if name == FORWARD:
        return "the module's forward"
    if name == "<global>":
        return "a process-wide forward hook"
    return f"the hook on {name or 'the module'}"


def differing_globals(then: str, now: str) -> list[str]:
    """The names of the globals whose readings differ between two :func:`held_values` texts
    (a setting, an adapter's weights), sorted; none where what differs is no global (a
    closure cell, a default).

    Example:
        >>> differing_globals("function(c,global G={'a':1})", "function(c,global G={'a':2})")
        ['G']
    """

    def pairs(text: str) -> set[tuple[str, str]]:
        parts = GLOBAL_READ.split(text)
        return set(zip(parts[1::2], parts[2::2], strict=True))

    return sorted({name for name, _ in pairs(then) ^ pairs(now)})


#: Where a held_values text names a global its code reads (``global ADAPTER=``).
GLOBAL_READ = re.compile(r"global ([\w.]+)=")


def elsewhere_message(label: str, differs: str) -> str:
    """The one line refusing a miss in a copy of the dataset in another process whose hooks
    read other values than its keys were made with (:func:`hooks_differ`'s ``differs``)."""
    return (
        f"the encoder module {label} would encode a miss in this process with other values "
        f"than the dataset's keys were made with ({differs}): a DataLoader "
        "worker started by spawn or forkserver imports the script anew, so what main() "
        "loaded or set after the import is not there; load the adapter's weights and set "
        "such settings when the script is imported, use "
        "DataLoader(..., multiprocessing_context='fork'), or make the adapter a submodule of "
        "the encoder"
    )


def same_hooks(now: Sequence[Any], then: Sequence[Any]) -> bool:
    """Whether two :func:`hooks_now` readings hold the same hook objects, where they were,
    holding the same values.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> h = m.register_forward_hook(print)
        >>> same_hooks(hooks_now(m), hooks_now(m)), same_hooks(hooks_now(m), ())
        (True, False)
    """
    return len(now) == len(then) and all(
        a[:2] == b[:2] and a[2] is b[2] and a[3] == b[3] for a, b in zip(now, then, strict=True)
    )


def weight_dtypes(module: Any) -> tuple[str, ...]:
    """The dtypes of a module's floating-point weights, sorted (none: no ``nn.Module``)."""
    if not isinstance(module, torch.nn.Module):
        return ()
    tensors = chain(module.parameters(), module.buffers())
    return tuple(sorted({str(t.dtype) for t in tensors if t.is_floating_point()}))


def encode_inputs(
    enc: LoadedEncoder, inputs: list[torch.Tensor], recipe: Recipe, own_rows: bool = True
) -> list[Parts]:
    """Each input's output parts; inputs of equal shape are encoded as one batch
    (``own_rows``: see :func:`~featbake.encode.outputs.encode_batch`)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j, x in enumerate(inputs):
        groups.setdefault(tuple(x.shape), []).append(j)
    results: list[Parts] = [{} for _ in inputs]
    for members in groups.values():
        batch = [inputs[j] for j in members]
        encoded = encode_batch(enc, batch, recipe, own_rows=own_rows)
        for j, parts in zip(members, encoded, strict=True):
            results[j] = parts
    return results


def miss_source(index: Index, source: Source) -> Source:
    """What decodes ``index``'s items on a miss: ``source``, or its inputs' own reader of it
    (a bucket's objects and a manifest's rows, which checks by itself that an item is the one
    hashed: the response's ETag, the file's stat)."""
    return index.inputs.source(source) if index.inputs is not None else source


def decode_items(
    source: Source, index: Index, idx: Sequence[int], fps: tuple[str, str]
) -> list[torch.Tensor]:
    """Items ``idx`` decoded as a miss decodes them, each checked to hold the bytes its key
    was hashed from (``fps``: the encoder and recipe fingerprints of the keys).

    Raises:
        SourceError: an input cannot be read, or changed since the index was made.
    """
    paths = [index.path(i) for i in idx]
    if isinstance(source, CheckingSource):  # each checked by the response that carried it
        stats = [FileStat(*map(int, index.stats[i])) for i in idx]
        return [load_unchanged(source, p, s) for p, s in zip(paths, stats, strict=True)]
    return [
        decoded_as_hashed(source, p, index.key(i), fps) for p, i in zip(paths, idx, strict=True)
    ]


def decoded_as_hashed(source: Source, path: str, key: str, fps: tuple[str, str]) -> torch.Tensor:
    """File ``path`` decoded from the very bytes checked to be the ones ``key`` was hashed
    from (read once, hashed, decoded from memory; ``fps``: (encoder, recipe) fingerprint).
    Decoding the file and hashing it again afterwards let a file rewritten and put back in
    between (an A/B/A swap) store B's features under A's key, served to every copy of A.

    Raises:
        SourceError: it cannot be read, or no longer holds those bytes.
    """
    data = bytes_at(path).read(path).data
    if feature_key(fps[0], fps[1], sha256_hex(data)) != key:
        raise SourceError(
            f"{path} changed since this dataset was created (its bytes no longer match "
            "the key they were indexed under), so its feature is not stored; create the "
            "dataset again once the file stops changing, or pass revalidate=True to serve "
            "each file as it is when read"
        )
    return source.load(path, io.BytesIO(data))


class Misses:
    """Items the store does not hold: read back from this process's write-back, found again
    in the catalog (another process wrote them), or decoded, encoded and written back.

    Args:
        index: the dataset's index (its shard column is pointed at written-back shards).
        reads: the dataset's read paths (to look an item up again).
        live: the encoder.
        source: decodes inputs as the recipe says.
        recipe: the recipe (dtype of stored outputs).

    Attributes:
        on_miss: ``"encode"`` or ``"error"`` (raise :class:`CacheMiss`).
        write_back: store what is encoded.
    """

    def __init__(
        self, index: Index, reads: Reads, live: LiveEncoder, source: Source, recipe: Recipe
    ) -> None:
        self.index = index
        self.reads = reads
        self.live = live
        self.source = miss_source(index, source)  # a bucket's or a manifest's own reader
        self.recipe = recipe
        self.recipe_fp = recipe.fingerprint()
        self.on_miss = "encode"
        self.write_back = True

    def configure(self, on_miss: str, write_back: bool) -> None:
        """Set what a miss does; warn once when misses will be encoded although the store
        built the same data with this encoder under other options (naming them)."""
        self.on_miss, self.write_back = on_miss, write_back
        missing = int((self.index.shard < 0).sum())
        data = self.index.data_dir
        if on_miss != "encode" or not missing or data is None:
            return
        builds = stored_builds(self.live.layout, data)
        asked = self.recipe.as_dict()
        text = live_encoding_warning(data, missing, len(self.index), self.live.label, asked, builds)
        if text is not None:
            warnings.warn(text, stacklevel=3)

    @property
    def fps(self) -> tuple[str, str]:
        """(encoder, recipe) fingerprint: what each item's key is made of, with its digest."""
        return self.live.fingerprint, self.recipe_fp

    def cache_miss(self, i: int) -> CacheMiss:
        """The error for item ``i`` with ``on_miss="error"``: what is missing, which option
        differs from how the store built this data, and the command (see miss_advice)."""
        path = self.index.path(i)
        data = self.index.data_dir or os.path.dirname(path)
        return CacheMiss(
            miss_message(
                path,
                describe(self.live.layout),  # a bucket store by its URL, never its tier folder
                self.live.label,
                data,
                self.recipe.as_dict(),
                stored_builds(self.live.layout, data),
                getattr(self.index.inputs, "column", None),  # a manifest's or table's column
                self.live.loading_options(),
            )
        )

    def values(self, st: ProcessState, idx: list[int]) -> list[Any]:
        """The values of items ``idx`` (as stored), none of which was found where the index
        said: pending in this process's write-back, found again in the catalog, copied from a
        whole-output build, or encoded (misses encoded together); each kept in the RAM tier.

        Raises:
            CacheMiss: (``on_miss="error"``) an item is not in the store.
            SourceError: an input changed since the dataset was made.
        """
        out: dict[int, Any] = {}
        todo: list[int] = []
        for i in idx:
            pending = pending_in_process(st.writeback, self.index.key(i))
            if pending is not None:
                out[i] = unpack(pending)
                continue
            value = self.reads.relocate(st, i)  # another process may have written it since
            if value is None:
                todo.append(i)
            else:
                st.touch(i)
                out[i] = value
        # A part a whole-output build stored is copied, not encoded (see serve/misses.py).
        copied = copied_parts(st, self.reads, self.index, self.fps, self.recipe, todo)
        todo = [i for i in todo if i not in copied]
        if todo and self.on_miss == "error":
            raise self.cache_miss(todo[0])
        for i, parts in copied.items():
            out[i] = unpack(parts)
            if self.write_back:
                self.store(st, i, parts)  # a copy written back: the read is served
        for i, parts in zip(todo, self.encode(st, todo) if todo else [], strict=True):
            # Served as a copy of its own (the rows are views of their batch, made in inference
            # mode); written back as they are: one copy per miss, not two.
            out[i] = unpack(owned_parts(parts))
            if self.write_back:
                self.store(st, i, parts, owned=True)
        if st.use_lru:  # a copy of the tier's own: the caller may edit what it is served
            for i in idx:
                st.lru.put(i, kept_copy(out[i]))
        return [out[i] for i in idx]

    def encode(self, st: ProcessState, idx: list[int]) -> list[Parts]:
        """Decode and encode items ``idx`` now (checking their files did not change); the
        encoder is checked right before it runs (an in-process module edited since the last
        misses is refused), so nothing runs between the check and the run."""
        inputs = decode_items(self.source, self.index, idx, self.fps)
        if st.encoder is None or self.live.spec is None:
            # An in-process module is checked and followed to its device at each batch of
            # misses: one moved since the last (`.cuda()`) met inputs sent where it was.
            st.encoder = self.live.for_this_process()
        else:
            self.live.refuse_changed()
        results = encode_inputs(st.encoder, inputs, self.recipe, own_rows=False)
        self.live.ran()
        st.encoded += len(idx)
        stored = [stored_parts(parts, self.recipe) for parts in results]  # int8/fp8: packed
        for i, parts in zip(idx, stored, strict=True):  # never served nor written back
            refuse_nonfinite(parts, self.recipe, self.index.path(i), NONFINITE_BUILD)
        return stored

    def store(self, st: ProcessState, i: int, parts: Parts, owned: bool = False) -> None:
        """Write item ``i``'s encoded parts back (once per key while pending); ``owned``:
        nothing else holds or serves them (see :meth:`WriteBack.add`)."""
        key = self.index.key(i)
        if not st.writeback.holds(key):
            st.pending_idx.setdefault(key, []).append(i)
            st.writeback.add(self.live.fingerprint, key, parts, owned)

    def published(self, st: ProcessState | None, shard: SealedShard) -> None:
        """A write-back shard was sealed: point the items written to it at it, those whose
        key it still is (``revalidate=True`` re-keys an item whose file changed meanwhile:
        its new key's feature is elsewhere, and this shard does not hold it)."""
        ix = self.index
        sid = ix.sid(shard.name)
        for entry in shard.entries:
            for i in st.pending_idx.pop(entry.key, ()) if st is not None else ():
                if ix.key(i) != entry.key:
                    continue
                ix.shard[i] = sid
                ix.length[i] = max(int(ix.length[i]), entry.shape[0] if entry.shape else 1)
        if ix.parts is None:
            ix.parts = tuple(sorted({e.part for e in shard.entries}))


def unpack(parts: Mapping[str, torch.Tensor]) -> Any:
    """A dataset item from its parts: the tensor itself, or a dict of parts."""
    return parts[""] if len(parts) == 1 and "" in parts else dict(parts)


def stored_builds(layout: Layout, data: str) -> list[StoredBuild]:
    """How the store built ``data`` (every root of that folder), newest first; none when its
    catalog cannot be read (the miss is reported all the same)."""
    if not layout.catalog.exists():
        return []
    try:
        with Catalog(layout, read_only=True) as catalog:
            roots = [r for r in catalog.roots() if r.data == data]
    except (FeatbakeError, sqlite3.Error):
        return []
    roots.sort(key=lambda r: r.last_used, reverse=True)
    return [StoredBuild(r.encoder_label, r.recipe) for r in roots]


__all__ = [
    "LiveEncoder",
    "Misses",
    "decode_items",
    "encode_inputs",
    "miss_source",
    "unpack",
]
