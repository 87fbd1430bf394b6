"""Round fourteen's keying: a forward reading the module back through code outside its class
(a function of the user's, a global holding the module), an attribute written anew on one path
and kept on another, and a hook importing a module by ``importlib.import_module`` or a relative
import: each test compares what a dataset serves after a change with the encoder run now
(docs/reliability.md, "Round fourteen: keying")."""

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
    _served_live_after,
    _served_live_after_a_new_scale,
    _user_package,
)
from tests.serve.test_watch_keys_review3 import _Scaled

THIS_MODULE = sys.modules[__name__]  # a module of the user's holding the encoder

# -- the module read back through code outside its class -------------------------------------------

#: The encoder, kept at module level by the user's script (``ENC = model``).
ENC: Any = None
#: An object of the user's holding it (``STATE.model = model``).
HOLDER = types.SimpleNamespace(model=None)
#: A bound method of the encoder kept as a global (``CURRENT = model.current``).
CURRENT: Any = None
#: A function whose closure holds the encoder (``READER = reader_of(model)``).
READER: Any = None


def _enc_scale() -> torch.Tensor:
    return ENC.scale * 1


def _outer() -> torch.Tensor:
    return _enc_scale()


def _scale_times(k: float) -> torch.Tensor:
    return ENC.scale * k


PARTIAL = functools.partial(_scale_times, 1.0)


def _current(m: Any) -> torch.Tensor:
    return m.scale * 1


def _reader_of(m: Any) -> Any:
    def read() -> torch.Tensor:
        return m.scale * 1

    return read


class _Box:
    @staticmethod
    def current() -> torch.Tensor:
        return ENC.scale * 1


#: An encoder scaled by a tensor the user sets, which its forward writes back (round
#: thirteen's), here through code outside the class in one of the shapes below.
_Outside = _Scaled


class _ThroughFunctionOfSelf(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _current(self)


class _ThroughFunctionReadingGlobal(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _enc_scale()


class _ThroughTwoFunctions(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _outer().to(wav.device)


class _ThroughGlobalModule(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = ENC.scale.to(wav.device)


class _ThroughStaticmethodElsewhere(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _Box.current()


class _ThroughPartial(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = PARTIAL()


class _ThroughHolder(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = HOLDER.model.scale * 1


class _ThroughUsersModule(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = THIS_MODULE.ENC.scale * 1


class _ThroughBoundMethod(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = CURRENT() * 1


class _ThroughClosureOfFunction(_Outside):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = READER()


OUTSIDE = {
    "function-of-self": _ThroughFunctionOfSelf,
    "function-reading-global": _ThroughFunctionReadingGlobal,
    "two-functions": _ThroughTwoFunctions,
    "global-module": _ThroughGlobalModule,
    "staticmethod-elsewhere": _ThroughStaticmethodElsewhere,
    "partial": _ThroughPartial,
    "holder": _ThroughHolder,
    "users-module": _ThroughUsersModule,
    "bound-method": _ThroughBoundMethod,
    "closure-of-function": _ThroughClosureOfFunction,
}


@pytest.fixture
def held_globally(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set the globals above to hold a module the test gives (as the user's script would)."""

    def hold(module: Any) -> None:
        monkeypatch.setattr(THIS_MODULE, "ENC", module)
        monkeypatch.setattr(HOLDER, "model", module)
        monkeypatch.setattr(THIS_MODULE, "CURRENT", module.current)
        monkeypatch.setattr(THIS_MODULE, "READER", _reader_of(module))

    yield hold


@pytest.mark.parametrize("shape", list(OUTSIDE))
def test_a_setting_read_back_through_code_outside_the_class_stays_keyed(
    tmp_path: Path, audio_dir: Path, held_globally: Any, shape: str
) -> None:
    cls = OUTSIDE[shape]
    module = cls().eval()
    held_globally(module)
    assert "scale" not in derived_attributes(cls)

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


class _ThroughCallableAttribute(_Outside):
    def __init__(self) -> None:
        super().__init__()
        self.reader = functools.partial(_current, self)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.scale = self.reader()  # written, then read on the same path
        return TinyConvEncoder.forward(self, wav) * self.scale


def test_a_setting_read_back_through_a_callable_the_instance_holds_stays_keyed(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _ThroughCallableAttribute().eval()
    # the class's reading takes self.reader() as a submodule's call; the instance's reads
    # what it holds there (a partial holding the module), as every key and watch does
    assert "scale" in derived_attributes(_ThroughCallableAttribute)
    assert "scale" not in module_derived(module)

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


# -- what must stay derived: a table made anew through the user's own functions --------------------

#: A plain settings dict of the user's a table is made from.
TABLE = {"width": 64, "base": 100.0}


def _table(n: int) -> torch.Tensor:
    position = torch.arange(0, n, dtype=torch.float32).unsqueeze(1)
    return torch.sin(position / TABLE["base"]).expand(n, TABLE["width"]).clone()


class _TableThroughFunction(TinyConvEncoder):
    """A positional table made in ``forward`` by a module-level function of the user's from the
    input's length and plain settings only: derived state, neither keyed nor watched."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        if self.pe is None or self.pe.size(0) < x.size(1):
            self.pe = _table(x.size(1)).to(x.device)
        return x + self.pe[: x.size(1)]


def test_a_table_made_by_a_function_of_the_users_stays_derived(
    tmp_path: Path, audio_dir: Path
) -> None:
    assert "pe" in derived_attributes(_TableThroughFunction)
    module = _TableThroughFunction().eval()
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)
    _assert_live(second, module, 2)


# -- an attribute written anew on one path and kept or derived on another --------------------------


class _MovedOrReset(_Outside):
    """One statement a path: moved from what it was on one, made anew on the other."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if wav.numel():
            self.scale = self.scale.to(wav.device)
        else:
            self.scale = torch.ones(())


class _ResetOrKept(_Outside):
    """Made anew on a path no input takes; kept (the user's) on the other."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if wav.numel() < 0:
            self.scale = torch.ones(())


class _OneStatementEitherWay(_Outside):
    """Made anew or moved in one conditional expression: one write, joined."""

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = torch.ones(()) if wav.numel() < 0 else self.scale.to(wav.device)


class _DefaultWhereUnset(_Outside):
    """Made anew where unset (None), the user's value kept otherwise: a condition reads it,
    as a lazy table's does."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if self.scale is None:
            self.scale = torch.ones(())


@pytest.mark.parametrize(
    "cls",
    [
        _OneStatementEitherWay,
        _MovedOrReset,
        _ResetOrKept,
        _DefaultWhereUnset,
    ],
    ids=["one-statement", "moved-or-reset", "reset-or-kept", "default-where-unset"],
)
def test_a_setting_made_anew_on_one_path_only_stays_keyed(
    tmp_path: Path, audio_dir: Path, cls: type
) -> None:
    module = cls().eval()

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


class _LazyExtended(TinyConvEncoder):
    """A table kept where long enough, moved to the input's dtype where not, made anew where
    short (ESPnet's ``extend_pe``): made anew on one path, kept or derived on the others, and
    derived state, as the table is the forward's own."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        if self.pe is not None and self.pe.size(0) >= x.size(1):
            if self.pe.dtype != x.dtype:
                self.pe = self.pe.to(dtype=x.dtype)
        else:
            self.pe = _table(x.size(1)).to(x.device)
        return x + self.pe[: x.size(1)]


def test_a_table_made_anew_on_one_path_and_kept_on_another_stays_derived(
    tmp_path: Path, audio_dir: Path
) -> None:
    assert "pe" in derived_attributes(_LazyExtended)
    module = _LazyExtended().eval()
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)
    _assert_live(second, module, 2)


# -- a hook importing a module of the user's by importlib, __import__ or a relative import ---------

_PACKAGE = "review4_pkg"

_HOOKS_SOURCE = """
import importlib
from importlib import import_module


def by_import_module(module, args):
    cfg = importlib.import_module("review4_pkg.settings")
    return (args[0] * cfg.GAIN,)


def by_import_module_at_once(module, args):
    return (args[0] * importlib.import_module("review4_pkg.settings").GAIN,)


def by_import_module_imported_inside(module, args):
    import importlib as il
    return (args[0] * il.import_module("review4_pkg.settings").GAIN,)


def by_bare_import_module(module, args):
    return (args[0] * import_module("review4_pkg.settings").GAIN,)


def by_dunder_import(module, args):
    pkg = __import__("review4_pkg.settings")
    return (args[0] * pkg.settings.GAIN,)


def by_import_module_passed_on(module, args):
    return (args[0] * gain_of(importlib.import_module("review4_pkg.settings")),)


def gain_of(cfg):
    return cfg.GAIN


def relative_module(module, args):
    from . import settings
    return (args[0] * settings.GAIN,)


def relative_name(module, args):
    from .settings import GAIN
    return (args[0] * GAIN,)


def by_name_made_at_run_time(module, args):
    name = "review4_pkg." + "settings"
    return (args[0] * importlib.import_module(name).GAIN,)
"""

_SUB_HOOKS_SOURCE = """
def parent_module(module, args):
    from .. import settings
    return (args[0] * settings.GAIN,)


def parent_name(module, args):
    from ..settings import GAIN
    return (args[0] * GAIN,)


def sibling_name(module, args):
    from .local import GAIN
    return (args[0] * GAIN,)
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``review4_pkg`` written under ``tmp_path`` and put on ``sys.path``: ``settings.py``
    (``GAIN = 2.0``), ``hooks.py`` and ``sub/hooks.py`` (``sub/local.py``: ``GAIN = 2.0``)."""
    files = {
        "settings.py": "GAIN = 2.0\n",
        "hooks.py": _HOOKS_SOURCE,
        "sub/local.py": "GAIN = 2.0\n",
        "sub/hooks.py": _SUB_HOOKS_SOURCE,
    }
    with _user_package(tmp_path, monkeypatch, _PACKAGE, files) as root:
        yield root


def _served_after_gain_change(
    tmp_path: Path, audio_dir: Path, hook: Any, settings: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first dataset over ``hook``; then ``GAIN`` of module ``settings`` set to 3.0; a second
    dataset must serve what the module gives now (a miss encoded, never the old feature)."""
    module = _hooked(hook, pre=True)

    def change() -> None:
        monkeypatch.setattr(sys.modules[settings], "GAIN", 3.0)

    _served_live_after(audio_dir, module, tmp_path, change)


IMPORTED = [
    "by_import_module",
    "by_import_module_at_once",
    "by_import_module_imported_inside",
    "by_bare_import_module",
    "by_dunder_import",
    "by_import_module_passed_on",
]


@pytest.mark.parametrize("imported", [True, False], ids=["imported", "not-imported-yet"])
@pytest.mark.parametrize("how", IMPORTED)
def test_a_setting_of_a_module_imported_by_importlib_in_the_hook_is_keyed(
    tmp_path: Path,
    audio_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    package: Path,
    how: str,
    imported: bool,
) -> None:
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    if imported:
        importlib.import_module(f"{_PACKAGE}.settings")
    _served_after_gain_change(
        tmp_path, audio_dir, getattr(hooks, how), f"{_PACKAGE}.settings", monkeypatch
    )


@pytest.mark.parametrize(
    ("where", "how", "settings"),
    [
        ("hooks", "relative_module", "settings"),
        ("hooks", "relative_name", "settings"),
        ("sub.hooks", "parent_module", "settings"),
        ("sub.hooks", "parent_name", "settings"),
        ("sub.hooks", "sibling_name", "sub.local"),
    ],
)
def test_a_setting_of_a_module_imported_relatively_in_the_hook_is_keyed(
    tmp_path: Path,
    audio_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    package: Path,
    where: str,
    how: str,
    settings: str,
) -> None:
    hooks = importlib.import_module(f"{_PACKAGE}.{where}")
    importlib.import_module(f"{_PACKAGE}.{settings}")
    _served_after_gain_change(
        tmp_path, audio_dir, getattr(hooks, how), f"{_PACKAGE}.{settings}", monkeypatch
    )


def test_a_module_imported_by_a_name_made_at_run_time_is_refused_in_one_line(
    tmp_path: Path, audio_dir: Path, package: Path
) -> None:
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    module = _hooked(hooks.by_name_made_at_run_time, pre=True)
    assert "by_name_made_at_run_time" in _refusal(
        audio_dir, module, tmp_path, "imported by a name made at run time"
    )


def test_a_hook_importing_by_importlib_keeps_its_key_when_nothing_read_changes(
    tmp_path: Path, audio_dir: Path, package: Path
) -> None:
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    module = _hooked(hooks.by_import_module, pre=True)
    again = _baked_then_reopened(audio_dir, module, tmp_path)
    _assert_live(again, module, 1)


class _GainOfInput(TinyConvEncoder):
    """A gain made from the input by a method the forward calls, then read: written on every
    path before it is read, derived state."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.measure(wav)
        return super().forward(wav * self.gain)

    def measure(self, wav: torch.Tensor) -> None:
        self.gain = 1.0 + wav.abs().mean()


def test_a_value_a_method_writes_on_every_path_before_the_forward_reads_it_stays_derived(
    tmp_path: Path, audio_dir: Path
) -> None:
    assert "gain" in derived_attributes(_GainOfInput)
    module = _GainOfInput().eval()
    again = _baked_then_reopened(audio_dir, module, tmp_path, n=2)
    _assert_live(again, module, 2)
