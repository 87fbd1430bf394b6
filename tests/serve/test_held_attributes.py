"""A module's settings held as data or callables (r16.1-6): a settings dict, a namespace, a
dataclass, a lambda, a partial or a bound ``dict.get`` that a module class of the user's holds
and its forward reads. Each test changes one after a first run and compares what is served
with the encoder run now; the reverse tests check that an unchanged module, or one whose
forward records into a log, serves hits (docs/reliability.md, "Round sixteen: held
attributes")."""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featbake.encode.identity import attribute_identity, held_attribute, held_attribute_text
from featbake.keys import module_derived
from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder
from tests.serve.test_cached_encoder import frozen, waves
from tests.serve.test_watch_keys import (
    _assert_live,
    _baked_then_reopened,
    _served_live_after,
)


class _DictSettings(TinyConvEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = {"scale": 2.0, "names": ["a"]}

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.cfg["scale"]


class _NamespaceSettings(TinyConvEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(scale=2.0)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.cfg.scale


@dataclass
class _Settings:
    scale: float = 2.0


class _DataclassSettings(TinyConvEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Settings()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.cfg.scale


class _ListOfDicts(TinyConvEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.stages = [{"scale": 2.0}, {"scale": 1.0}]

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.stages[0]["scale"] * self.stages[1]["scale"]


class _ArrayWindow(TinyConvEncoder):
    def __init__(self) -> None:
        super().__init__()
        self.window = np.array([2.0, 1.0], dtype=np.float32)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * float(self.window[0])


class _HeldCallables(TinyConvEncoder):
    """``act``: a partial of library code holding a number; ``pick``: a bound ``dict.get``."""

    def __init__(self) -> None:
        super().__init__()
        self.act: Any = functools.partial(torch.mul, other=2.0)
        self.pick = {"scale": 1.0}.get

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(wav)) * self.pick("scale")


class _Statistics:
    """Global CMVN statistics a front-end keeps in an object of its own (not a buffer)."""

    def __init__(self) -> None:
        self.std = torch.tensor(2.0)


@dataclass
class _StatisticsRecord:
    std: torch.Tensor


class _HeldStatistics(TinyConvEncoder):
    """A tensor held inside an object, a ``SimpleNamespace`` and a dataclass (``kind``)."""

    def __init__(self, kind: str = "object") -> None:
        super().__init__()
        holders = {
            "object": _Statistics,
            "namespace": lambda: types.SimpleNamespace(std=torch.tensor(2.0)),
            "dataclass": lambda: _StatisticsRecord(torch.tensor(2.0)),
            "list": lambda: [_Statistics()],
            "dict": lambda: {"cmvn": types.SimpleNamespace(std=torch.tensor(2.0))},
        }
        self.cmvn = holders[kind]()

    @property
    def stats(self) -> Any:
        held = self.cmvn
        return (
            held[0] if isinstance(held, list) else held["cmvn"] if isinstance(held, dict) else held
        )

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.stats.std


class _HeldAdapter(TinyConvEncoder):
    """An adapter network kept in a namespace (no submodule: its weights are in no
    ``state_dict``), run on the output."""

    def __init__(self) -> None:
        super().__init__()
        adapter = torch.nn.Linear(1, 1).eval().requires_grad_(False)
        self.extra = types.SimpleNamespace(adapter=adapter)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        return self.extra.adapter(out.unsqueeze(-1)).squeeze(-1)


class _UnregisteredAdapter(TinyConvEncoder):
    """An adapter network set on the instance's ``__dict__``, not registered as a submodule
    (as a teacher is kept out of ``state_dict`` and ``.to()``), run on the output."""

    def __init__(self) -> None:
        super().__init__()
        adapter = torch.nn.Linear(1, 1).eval().requires_grad_(False)
        self.__dict__["adapter"] = adapter

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        return self.adapter(out.unsqueeze(-1)).squeeze(-1)


def _other_adapter(m: Any) -> None:
    torch.manual_seed(7)
    m.extra.adapter = torch.nn.Linear(1, 1).eval().requires_grad_(False)


class _NotesThenScales(_NamespaceSettings):
    """Sets a value of its own on the settings its base class's forward reads them from."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.cfg.last = wav.detach().mean()
        return super().forward(wav)


CHANGES = {
    "dict-edited": (_DictSettings, lambda m: m.cfg.__setitem__("scale", 3.0)),
    "dict-replaced": (_DictSettings, lambda m: setattr(m, "cfg", {"scale": 3.0, "names": ["a"]})),
    "namespace-edited": (_NamespaceSettings, lambda m: setattr(m.cfg, "scale", 3.0)),
    "dataclass-edited": (_DataclassSettings, lambda m: setattr(m.cfg, "scale", 3.0)),
    "list-of-dicts-edited": (_ListOfDicts, lambda m: m.stages[1].__setitem__("scale", 3.0)),
    "array-edited": (_ArrayWindow, lambda m: m.window.__setitem__(0, 3.0)),
    "array-replaced": (_ArrayWindow, lambda m: setattr(m, "window", m.window * 1.5)),
    "lambda-set": (_HeldCallables, lambda m: setattr(m, "act", lambda t: t * 3.0)),
    "partial-keywords-edited": (_HeldCallables, lambda m: m.act.keywords.__setitem__("other", 3.0)),
    "bound-get-dict-edited": (_HeldCallables, lambda m: m.pick.__self__.__setitem__("scale", 3.0)),
    # r23: a tensor inside a held object was read as its type only, in no key and no watch.
    "object-tensor-replaced": (_HeldStatistics, lambda m: setattr(m.cmvn, "std", m.cmvn.std * 2)),
    "object-tensor-edited": (_HeldStatistics, lambda m: m.cmvn.std.fill_(0.25)),
    "namespace-tensor-replaced": (
        functools.partial(_HeldStatistics, "namespace"),
        lambda m: setattr(m.cmvn, "std", torch.tensor(0.25)),
    ),
    "dataclass-tensor-edited": (
        functools.partial(_HeldStatistics, "dataclass"),
        lambda m: m.cmvn.std.mul_(3.0),
    ),
    "object-in-a-list-tensor-replaced": (
        functools.partial(_HeldStatistics, "list"),
        lambda m: setattr(m.stats, "std", torch.tensor(0.5)),
    ),
    # A subclass sets a value on the namespace its base reads ``scale`` from: only ``last``
    # is the forward's own (the first form of r23.3's second review made all of ``cfg`` so).
    "namespace-a-subclass-writes-into-edited": (
        _NotesThenScales,
        lambda m: setattr(m.cfg, "scale", 3.0),
    ),
    # r24.2: a module held inside such an object was read as its type only.
    "namespace-module-weights-edited": (
        _HeldAdapter,
        lambda m: m.extra.adapter.weight.mul_(3.0),
    ),
    "namespace-module-replaced": (_HeldAdapter, _other_adapter),
    # r26.8: an EMA update through ``.data`` keeps the version counters; an unregistered
    # module was read by no key at all.
    "namespace-module-weights-edited-through-data": (
        _HeldAdapter,
        lambda m: m.extra.adapter.weight.data.mul_(3.0),
    ),
    "unregistered-module-weights-edited": (
        _UnregisteredAdapter,
        lambda m: m.adapter.weight.mul_(3.0),
    ),
    "unregistered-module-weights-edited-through-data": (
        _UnregisteredAdapter,
        lambda m: m.adapter.weight.data.mul_(3.0),
    ),
    "namespace-in-a-dict-tensor-edited": (
        functools.partial(_HeldStatistics, "dict"),
        lambda m: m.stats.std.fill_(0.5),
    ),
}


@pytest.mark.parametrize("how", list(CHANGES))
def test_a_held_setting_changed_between_runs_is_not_served_stale(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """r16.1: each was left out of the key (only plain values were keyed), so the reopened
    dataset served the first run's features."""
    cls, change = CHANGES[how]
    module = cls().eval()
    _served_live_after(
        audio_dir, module, tmp_path, lambda: change(module), n=2 if how == "dict-edited" else 1
    )


@pytest.mark.parametrize("how", list(CHANGES))
def test_a_held_setting_changed_under_an_open_cached_encoder_is_not_served_stale(
    tmp_path: Path, how: str
) -> None:
    """r16.2: changed after three calls of one ``CachedEncoder`` (its RAM tier warm, its
    watch past the exact reads of its first calls): the watch reads the held values at each
    call (an edit in place keeps the object's id)."""
    cls, change = CHANGES[how]
    module = frozen(cls())
    served_live_by_an_open_cached_encoder(module, tmp_path, lambda: change(module))


def served_live_by_an_open_cached_encoder(module: Any, tmp_path: Path, change: Any) -> None:
    """Three calls of one ``CachedEncoder`` over frozen ``module`` (its RAM tier warm, its
    watch past its first exact reads), then ``change()``: the next call serves what the
    module returns now."""
    x = waves(2)
    cached = CachedEncoder(module, cache=tmp_path / "c")
    for _ in range(3):
        cached(x, ids=["a", "b"])
    change()
    with torch.inference_mode():
        now = module(x)
    torch.testing.assert_close(cached(x, ids=["a", "b"]), now)


@pytest.mark.parametrize(
    "cls", [_DictSettings, _NamespaceSettings, _HeldCallables, _UnregisteredAdapter]
)
def test_an_unchanged_held_setting_serves_hits(tmp_path: Path, audio_dir: Path, cls: type) -> None:
    """r16.3: no needless miss: a second pass of one ``CachedEncoder`` reads every row from the
    store (RAM tier off), and a dataset reopened with ``on_miss="error"`` serves them."""
    module = frozen(cls())
    assert_a_second_pass_hits(module, tmp_path / "c")
    reopened = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(reopened, module, 2)


def assert_a_second_pass_hits(module: torch.nn.Module, cache: Path) -> None:
    """A ``CachedEncoder`` over ``module`` on the store ``cache`` (RAM tier off) encodes three
    items on a first pass and reads every one from the store on a second."""
    x = waves(3)
    ids = [f"utt{i}" for i in range(3)]
    cached = CachedEncoder(module, cache=cache, ram_cache=0)
    cached(x, ids=ids)
    cached(x, ids=ids)
    info = cached.cache_info()
    assert info["encoded"] == 3 and sum(v for k, v in info.items() if k.startswith("hits_")) == 3


class _RecordsIntoALog(_DictSettings):
    """A forward that records into a dict it never reads back: derived state, not a setting.
    It calls the builtin ``float``, which was read as ``nn.Module.float`` (that hands ``self``
    on, so no attribute read as recorded into) until ``keys.attribute_names``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, Any] = {}

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        self.seen["last"] = float(out.mean())
        return out


def test_a_log_the_forward_records_into_stays_out_of_the_key(tmp_path: Path) -> None:
    """r16.4: ``self.seen`` changes at every forward; keyed, every call would miss."""
    module = frozen(_RecordsIntoALog())
    before = attribute_identity(module)
    x = waves(2)
    cached = CachedEncoder(module, cache=tmp_path / "c", ram_cache=0)
    cached(x, ids=["a", "b"])
    cached(x, ids=["a", "b"])
    assert module.seen and attribute_identity(module) == before
    assert cached.cache_info()["encoded"] == 2


class _KeepsADebugValue(TinyConvEncoder):
    """A forward that sets a tensor on an object of its own and never reads it back."""

    def __init__(self) -> None:
        super().__init__()
        self.monitor = _Statistics()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        self.monitor.std = out.detach().pow(2).mean()
        return out


class _KeepsDebugValuesInAList(TinyConvEncoder):
    """The same, on an object held in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.monitors = [_Statistics()]

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        self.monitors[0].std = out.detach().pow(2).mean()
        return out


@pytest.mark.parametrize("cls", [_KeepsADebugValue, _KeepsDebugValuesInAList])
def test_a_tensor_the_forward_sets_on_an_object_of_its_own_stays_out_of_the_key(
    tmp_path: Path, audio_dir: Path, cls: type
) -> None:
    """r23.3's first form read a held object's tensors by value, this one's too: each forward
    changed the key, so a dataset made after a run missed every item (``on_miss="error"``
    raised; by default each was encoded again under new keys). A name the forward sets on an
    object held under an attribute (``self.monitor.x = v``, ``self.monitors[0].x = v``) is
    derived state (``written_below``), left out; the rest of that object stays keyed."""
    module = frozen(cls())
    before = attribute_identity(module)
    with torch.inference_mode():
        module(waves(1))
    assert attribute_identity(module) == before
    again = _baked_then_reopened(audio_dir, module, tmp_path / "a", n=2)  # on_miss="error"
    _assert_live(again, module, 2)


class _HoldsWhatNoKeyReads(_DictSettings):
    """A held object keyed by nothing but its address (no attributes, the default repr)."""

    def __init__(self) -> None:
        super().__init__()
        self.handle = _Opaque()


class _Opaque:
    __slots__ = ()


def test_a_held_value_no_key_can_read_is_left_out_not_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """r16.5: an object read only by its address is left out of the key as before (one in
    each process would never hit), the rest of the module still keyed: its dict edited is
    not served stale, and unchanged it serves hits."""
    module = frozen(_HoldsWhatNoKeyReads())
    assert held_attribute("handle", module.handle, module_derived(module))
    assert held_attribute_text(module, module.handle, exact=True) is None
    again = _baked_then_reopened(audio_dir, module, tmp_path / "a", n=2)  # on_miss="error"
    _assert_live(again, module, 2)
    _served_live_after(audio_dir, module, tmp_path, lambda: module.cfg.__setitem__("scale", 3.0))


def test_a_library_modules_held_values_keep_the_key_they_had() -> None:
    """r16.6: torch's classes hold library functions (``TransformerEncoderLayer.activation``):
    left out, so a torch upgrade that edits one changes no key; a class of the user's that
    holds the same function is keyed by it."""
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32)
    before = attribute_identity(layer)
    layer.activation = torch.nn.functional.gelu
    assert attribute_identity(layer) == before

    mine = _HeldCallables()
    before = attribute_identity(mine)
    mine.act = torch.nn.functional.gelu
    assert attribute_identity(mine) != before


def test_a_transformers_models_config_changed_under_a_cached_encoder_is_not_served_stale(
    tmp_path: Path,
) -> None:
    """A transformers model's forward reads ``self.config`` (``return_dict``,
    ``output_hidden_states``), a library class's held value, which was neither keyed nor
    watched: set after the wrapper's first calls, it kept serving the old output (a dict where
    the model now returns a tuple), and a new wrapper over the changed model hit the old
    rows too. Now the config is keyed by its settings and watched at each call; set back,
    the first rows are hits again (where the model was loaded from is no setting)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8,
    )  # fmt: skip
    vit = frozen(transformers.ViTModel(config))
    x, ids = torch.randn(2, 3, 32, 32), ["a", "b"]
    cached = CachedEncoder(vit, cache=tmp_path / "c", ram_cache=0)
    for _ in range(3):  # past the exact reads of its first calls
        cached(x, ids=ids)
    vit.config.return_dict = False
    with torch.inference_mode():
        now = vit(x)
    assert isinstance(now, tuple)
    torch.testing.assert_close(cached(x, ids=ids), now)
    fresh = CachedEncoder(vit, cache=tmp_path / "c", ram_cache=0)
    torch.testing.assert_close(fresh(x, ids=ids), now)
    vit.config.return_dict = True
    vit.config._name_or_path = str(tmp_path / "elsewhere")
    back = CachedEncoder(vit, cache=tmp_path / "c", ram_cache=0)
    with torch.inference_mode():
        torch.testing.assert_close(dict(back(x, ids=ids)), dict(vit(x)))
    assert back.cache_info()["encoded"] == 0
