"""Round fifteen's keying: a setting given a default where unset (``if self.scale is None``),
told apart from a lazy table (whose guard compares it with the input), a setting read back
through a callable the instance holds (a partial, a lambda, a bound method, an object holding
one), read with what the instance holds, and a hook passing ``sys`` or ``sys.modules`` on
whole; each test compares what a dataset serves after a change with the encoder run now
(docs/reliability.md, "Round fifteen: keying")."""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.keys import derived_attributes, module_derived
from featbake.testing import TinyConvEncoder
from tests.serve.test_watch_keys import (
    _assert_live,
    _baked_then_reopened,
    _hooked,
    _refusal,
    _served_live_after_a_new_scale,
    _user_package,
)
from tests.serve.test_watch_keys_review3 import _Scaled
from tests.serve.test_watch_keys_review4 import _current, _table

# -- a default where unset: the user's value the same code keeps is a setting ---------------------

#: A sentinel of the user's for "not set".
_UNSET: Any = object()


class _DefaultOnTheInputsDevice(_Scaled):
    """Made anew on the input's device where unset: still a default, not a table."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if self.scale is None:
            self.scale = torch.ones((), device=wav.device)


class _DefaultWhereNoTensor(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        if not torch.is_tensor(self.scale):
            self.scale = torch.ones(())


class _DefaultBySentinel(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        if self.scale is _UNSET:
            self.scale = torch.ones(())


class _DefaultThroughAMethod(_Scaled):
    """The condition a method of the class's: it reads the setting against a constant only."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if self._unset():
            self.scale = torch.ones(())

    def _unset(self) -> bool:
        return self.scale is None


class _DefaultMadeByAMethod(_Scaled):
    """The write in a method called under the condition."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if self.scale is None:
            self._reset()

    def _reset(self) -> None:
        self.scale = torch.ones(())


DEFAULTS = {
    "on-the-inputs-device": _DefaultOnTheInputsDevice,
    "where-no-tensor": _DefaultWhereNoTensor,
    "by-sentinel": _DefaultBySentinel,
    "through-a-method": _DefaultThroughAMethod,
    "made-by-a-method": _DefaultMadeByAMethod,
}


@pytest.mark.parametrize("shape", list(DEFAULTS))
def test_a_setting_given_a_default_where_unset_stays_keyed(
    tmp_path: Path, audio_dir: Path, shape: str
) -> None:
    cls = DEFAULTS[shape]
    module = cls().eval()
    assert "scale" not in derived_attributes(cls)
    assert "scale" not in module_derived(module)

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


# -- what must stay derived: a table whose guard compares it with the input -----------------------


class _TableGuardedByAMethod(TinyConvEncoder):
    """A lazy table made anew where a method of the class's says it is too short for the
    input: the method compares it with its argument."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        if self._too_short(x):
            self.pe = _table(x.size(1)).to(x.device)
        return x + self.pe[: x.size(1)]

    def _too_short(self, x: torch.Tensor) -> bool:
        return self.pe is None or self.pe.size(0) < x.size(1)


class _MaskOnTheInputsDevice(TinyConvEncoder):
    """A mask made anew where none is or it is on another device than the input."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        if self.mask is None or self.mask.device != x.device:
            self.mask = torch.ones(x.size(2), device=x.device)
        return x * self.mask


TABLES = {
    "guarded-by-a-method": (_TableGuardedByAMethod, "pe"),
    "mask": (_MaskOnTheInputsDevice, "mask"),
}


@pytest.mark.parametrize("shape", list(TABLES))
def test_a_table_made_anew_where_the_input_outgrows_it_stays_derived(
    tmp_path: Path, audio_dir: Path, shape: str
) -> None:
    cls, name = TABLES[shape]
    module = cls().eval()
    assert name in derived_attributes(cls) and name in module_derived(module)
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)  # on_miss="error"
    _assert_live(second, module, 2)


# -- a setting read back through a callable the instance holds -------------------------------------


class _HeldReader(_Scaled):
    """``scale`` written, then read on the same path, from a callable the instance holds."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.rewrite(wav)
        return TinyConvEncoder.forward(self, wav) * self.scale


class _ThroughHeldLambda(_HeldReader):
    def __init__(self) -> None:
        super().__init__()
        self.reader = lambda: self.scale * 1

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.reader()


class _ThroughHeldBoundMethod(_HeldReader):
    def __init__(self) -> None:
        super().__init__()
        self.reader = self.current

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.reader() * 1


class _ThroughHeldLocal(_HeldReader):
    def __init__(self) -> None:
        super().__init__()
        self.reader = functools.partial(_current, self)

    def rewrite(self, wav: torch.Tensor) -> None:
        read = self.reader
        self.scale = read()


class _ThroughHeldHelper(_HeldReader):
    def __init__(self) -> None:
        super().__init__()
        self.helper = types.SimpleNamespace(current=functools.partial(_current, self))

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.helper.current()


class _ThroughHeldList(_HeldReader):
    def __init__(self) -> None:
        super().__init__()
        self.readers = [functools.partial(_current, self)]

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.readers[0]()


class _ThroughSelfInAListBesideAHeldValue(_HeldReader):
    """Self put in a list beside a value an attribute holds, then read back out of it."""

    def __init__(self) -> None:
        super().__init__()
        self.helper = types.SimpleNamespace(current=None)

    def rewrite(self, wav: torch.Tensor) -> None:
        pair = [self, self.helper]
        self.scale = pair[0].scale * 1


HELD = {
    "lambda": _ThroughHeldLambda,
    "bound-method": _ThroughHeldBoundMethod,
    "local": _ThroughHeldLocal,
    "helper-object": _ThroughHeldHelper,
    "list": _ThroughHeldList,
    "self-in-a-list": _ThroughSelfInAListBesideAHeldValue,
}


@pytest.mark.parametrize("shape", list(HELD))
def test_a_setting_read_back_through_what_the_instance_holds_stays_keyed(
    tmp_path: Path, audio_dir: Path, shape: str
) -> None:
    module = HELD[shape]().eval()
    assert "scale" not in module_derived(module)

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


# -- what must stay derived: a value made by a submodule or a library function the instance holds --


class _KeepsItsHeadsOutput(TinyConvEncoder):
    """A forward keeping what a submodule and a library function it holds gave (a probe's
    log), neither read back: derived state, found with ``on_miss="error"``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(64, 4)
        self.act = torch.tanh
        self.norm = functools.partial(torch.nn.functional.layer_norm, normalized_shape=(4,))
        self.last: torch.Tensor | None = None
        self.normed: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        self.last = self.act(self.head(x)).detach()
        self.normed = self.norm(self.last)
        return x


def test_a_value_made_by_a_submodule_or_library_function_the_instance_holds_stays_derived(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _KeepsItsHeadsOutput().eval()
    assert {"last", "normed"} <= module_derived(module)
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)  # on_miss="error"
    _assert_live(second, module, 2)


def test_a_value_made_by_a_function_of_the_users_the_instance_holds_is_keyed() -> None:
    """The same class holding a function of the user's where it held ``torch.tanh``: what it
    makes is keyed (the function may read the module back), on this instance only."""
    module = _KeepsItsHeadsOutput().eval()
    module.act = lambda t: torch.tanh(t) * 1
    assert "last" not in module_derived(module) and "normed" not in module_derived(module)
    assert {"last", "normed"} <= module_derived(_KeepsItsHeadsOutput())


# -- the library's module classes read as before ---------------------------------------------------

#: The library module classes whose forward writes an attribute of its own (all private).
_LIBRARY_DERIVED = {
    "torch.nn.modules.rnn.GRU": ["_flat_weight_refs"],
    "torch.nn.modules.rnn.LSTM": ["_flat_weight_refs"],
    "torch.nn.modules.rnn.RNN": ["_flat_weight_refs"],
    **{
        f"transformers.models.wav2vec2.modeling_wav2vec2.{name}": ["_hf_peft_config_loaded"]
        for name in (
            "Wav2Vec2ForCTC",
            "Wav2Vec2ForPreTraining",
            "Wav2Vec2ForSequenceClassification",
            "Wav2Vec2ForXVector",
            "Wav2Vec2Model",
        )
    },
}


def test_library_module_classes_derive_what_they_did() -> None:
    """Every module class of ``torch.nn`` and transformers' wav2vec2, whisper and bert: the
    attributes read as derived state are the ones pinned (on 5170a1f too). ``RNNBase`` (no
    forward of its own) left the pin in round sixteen: the unimplemented forward's
    ``type(self)`` was read as ``nn.Module.type``, reaching ``_apply``; a global name is no
    attribute (``keys.attribute_names``)."""
    pytest.importorskip("transformers")
    modules = [
        torch.nn,
        *[m for n, m in sorted(sys.modules.items()) if n.startswith("torch.nn.modules")],
    ]
    for name in ("wav2vec2", "whisper", "bert"):
        modules.append(importlib.import_module(f"transformers.models.{name}.modeling_{name}"))
    classes = {
        f"{obj.__module__}.{obj.__qualname__}": obj
        for m in modules
        for obj in vars(m).values()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module)
    }
    assert len(classes) > 200
    found = {k: sorted(derived_attributes(c)) for k, c in sorted(classes.items())}
    assert {k: v for k, v in found.items() if v} == _LIBRARY_DERIVED


# -- r14kr.7's leftovers: sys.modules passed on whole, sys passed on, getattr(sys, "modules") ------

_PACKAGE = "review6_pkg"

_HOOKS_SOURCE = """
import sys
from sys import modules


def gain_of_modules(mods):
    return mods["review6_pkg.settings"].GAIN


def gain_of_sys(s):
    return s.modules["review6_pkg.settings"].GAIN


def by_modules_passed_on(module, args):
    return (args[0] * gain_of_modules(modules),)


def by_sys_passed_on(module, args):
    return (args[0] * gain_of_sys(sys),)


def by_sys_imported_inside_passed_on(module, args):
    import sys as system
    return (args[0] * gain_of_sys(system),)


def by_getattr_of_sys(module, args):
    return (args[0] * getattr(sys, "modules")["review6_pkg.settings"].GAIN,)


def by_getattr_of_sys_by_a_name(module, args):
    name = "mod" + "ules"
    return (args[0] * getattr(sys, name)["review6_pkg.settings"].GAIN,)


def by_getattr_of_sys_imported_inside(module, args):
    import sys
    return (args[0] * getattr(sys, "modules").get("review6_pkg.settings").GAIN,)


def reads_sys_argv_by_getattr(module, args):
    return (args[0] * (1.0 if getattr(sys, "argv") is not None else 1.0),)


def writes_to_sys_stderr(module, args):
    print("", end="", file=sys.stderr)
    return (args[0] * 1.0,)


def tests_membership_of_modules(module, args):
    return (args[0] * (1.0 if "math" in modules else 1.0),)
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``review6_pkg`` under ``tmp_path`` on ``sys.path``: ``settings.py`` (``GAIN = 2.0``)
    and ``hooks.py``."""
    files = {"settings.py": "GAIN = 2.0\n", "hooks.py": _HOOKS_SOURCE}
    with _user_package(tmp_path, monkeypatch, _PACKAGE, files) as root:
        yield root


#: What each hook is refused as: ``sys.modules`` as a global read whole is a value too large
#: to key (refused so before this round too), the others by no name a reading knows.
REFUSED = {
    "by_modules_passed_on": r"holds modules \(a value too large",
    **{
        how: r"taken out of sys\.modules"
        for how in (
            "by_sys_passed_on",
            "by_sys_imported_inside_passed_on",
            "by_getattr_of_sys",
            "by_getattr_of_sys_by_a_name",
            "by_getattr_of_sys_imported_inside",
        )
    },
}


@pytest.mark.parametrize("how", list(REFUSED))
def test_sys_modules_or_sys_passed_on_whole_is_refused_in_one_line(
    tmp_path: Path, audio_dir: Path, package: Path, how: str
) -> None:
    """No reading knows which module the code it goes to takes out of it: refused, as
    ``sys.modules[name]`` is (r14kr.7), never served stale after ``GAIN`` changes."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    importlib.import_module(f"{_PACKAGE}.settings")
    module = _hooked(getattr(hooks, how), pre=True)
    assert how in _refusal(audio_dir, module, tmp_path, REFUSED[how])


@pytest.mark.parametrize(
    "how", ["reads_sys_argv_by_getattr", "writes_to_sys_stderr", "tests_membership_of_modules"]
)
def test_sys_read_by_attribute_is_not_refused(
    tmp_path: Path, audio_dir: Path, package: Path, how: str
) -> None:
    """``getattr(sys, "argv")`` (a process setting, keyed), ``sys.stderr`` and ``"math" in
    modules`` read no module out of ``sys.modules``: served, the key kept."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    module = _hooked(getattr(hooks, how), pre=True)
    again = _baked_then_reopened(audio_dir, module, tmp_path)  # on_miss="error"
    _assert_live(again, module, 1)
