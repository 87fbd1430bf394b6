"""A review of round fourteen's keying: a forward reading the module back through a function
a closure or a default holds, a write counted at a call that need not run on self, and a hook
importing a module through an alias of ``importlib.import_module`` or taking it out of
``sys.modules``; each test compares what a dataset serves after a change with the encoder run
now (docs/reliability.md, "Round fourteen: review of the keying")."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.errors import EncoderLoadError
from featbake.keys import derived_attributes
from featbake.serve.dataset import CachedFeatureDataset
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

#: The encoder, kept at module level by the user's script (``ENC = model``).
ENC: Any = None


def _logged(fn: Any) -> Any:
    """A hand-written decorator (no ``functools.wraps``): its closure holds ``fn``."""

    def inner(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return inner


@_logged
def _logged_scale() -> torch.Tensor:
    return ENC.scale * 1


def _default_reader(get: Any = lambda: ENC.scale * 1) -> torch.Tensor:
    return get()


class _ThroughHandWrittenDecorator(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _logged_scale()


class _ThroughDefaultFunction(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = _default_reader()


def _tidy(self: Any) -> None:
    """A function outside the class whose argument is named ``self`` (monkey-patching style)."""
    self.scale = torch.ones(())


class _TidiesAnotherObject(_Scaled):
    """Resets a helper object's ``scale`` through ``_tidy``, never its own; its own is made
    anew only on a path no input takes."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = types.SimpleNamespace(scale=None)

    def rewrite(self, wav: torch.Tensor) -> None:
        _tidy(self.aux)
        if wav.numel() < 0:
            self.scale = torch.ones(())


class _GeneratorNeverRun(_Scaled):
    """Calls a generator method (whose body the call does not run) that writes ``scale``."""

    def rewrite(self, wav: torch.Tensor) -> None:
        self.steps()
        if wav.numel() < 0:
            self.scale = torch.ones(())

    def steps(self) -> Iterator[None]:
        self.scale = torch.ones(())
        yield


class _ConditionOnTheSetting(_Scaled):
    """Made anew on a path no input takes; the forward applies the user's scale only where it
    is not one (a condition reads it, as a lazy table's does, but guards no write)."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if wav.numel() < 0:
            self.scale = torch.ones(())

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.rewrite(wav)
        y = TinyConvEncoder.forward(self, wav)
        if self.scale.item() != 1.0:
            y = y * self.scale
        return y


class _ConditionOnAValueOfTheSetting(_Scaled):
    """The same with the condition on a value computed from the setting (a clamp check)."""

    def rewrite(self, wav: torch.Tensor) -> None:
        if wav.numel() < 0:
            self.scale = torch.ones(())

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.rewrite(wav)
        y = TinyConvEncoder.forward(self, wav) * self.scale
        if y.abs().max() > 1e9:
            y = y.clamp(-1e9, 1e9)
        return y


SHAPES = {
    "hand-written-decorator": _ThroughHandWrittenDecorator,
    "default-function": _ThroughDefaultFunction,
    "tidies-another-object": _TidiesAnotherObject,
    "generator-never-run": _GeneratorNeverRun,
    "condition-on-the-setting": _ConditionOnTheSetting,
    "condition-on-a-value-of-it": _ConditionOnAValueOfTheSetting,
}


@pytest.mark.parametrize("cls", list(SHAPES.values()), ids=list(SHAPES))
def test_a_setting_the_forward_keeps_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, cls: type
) -> None:
    module = cls().eval()
    monkeypatch.setattr(sys.modules[__name__], "ENC", module)
    assert "scale" not in derived_attributes(cls)

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


# -- a hook importing a module through an alias of importlib.import_module -------------------------

_PACKAGE = "review5_pkg"

_HOOKS_SOURCE = """
import importlib
import sys

IMPORT = importlib.import_module
IMPORTERS = {"import": importlib.import_module}


def by_getattr(module, args):
    return (args[0] * getattr(importlib, "import_module")("review5_pkg.settings").GAIN,)


def by_global_alias(module, args):
    return (args[0] * IMPORT("review5_pkg.settings").GAIN,)


def by_dict(module, args):
    return (args[0] * IMPORTERS["import"]("review5_pkg.settings").GAIN,)


def by_package_keyword(module, args):
    return (args[0] * importlib.import_module(".settings", package="review5_pkg").GAIN,)


def by_sys_modules(module, args):
    return (args[0] * sys.modules["review5_pkg.settings"].GAIN,)


def by_sys_modules_get(module, args):
    return (args[0] * sys.modules.get("review5_pkg.settings", None).GAIN,)


def by_sys_modules_imported_inside(module, args):
    import sys as system
    loaded = system.modules
    cfg = loaded["review5_pkg.settings"]
    return (args[0] * cfg.GAIN,)


def by_sys_modules_from_import(module, args):
    from sys import modules
    return (args[0] * modules.get("review5_pkg.settings").GAIN,)


def by_sys_modules_name_made_at_run_time(module, args):
    name = "review5_pkg." + "settings"
    return (args[0] * sys.modules[name].GAIN,)


def by_sys_modules_get_made_at_run_time(module, args):
    name = "review5_pkg." + "settings"
    return (args[0] * sys.modules.get(name).GAIN,)


def by_sys_modules_values(module, args):
    gain = [m for m in list(sys.modules.values()) if m.__name__ == "review5_pkg.settings"]
    return (args[0] * gain[0].GAIN,)


def by_sys_modules_of_a_library(module, args):
    return (args[0] * sys.modules["math"].sqrt(4.0) / 2 * sys.modules["torch"].ones(()),)


def by_import_of_a_library(module, args):
    import math
    import torch
    return (args[0] * math.sqrt(4.0) / 2 * torch.ones(()),)


def by_sys_modules_membership(module, args):
    return (args[0] * (1.0 if "math" in sys.modules else 1.0),)
"""

HOOKS = [
    "by_getattr",
    "by_global_alias",
    "by_dict",
    "by_package_keyword",
    "by_sys_modules",
]


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``review5_pkg`` under ``tmp_path`` on ``sys.path``: ``settings.py`` (``GAIN = 2.0``)
    and ``hooks.py``."""
    files = {"settings.py": "GAIN = 2.0\n", "hooks.py": _HOOKS_SOURCE}
    with _user_package(tmp_path, monkeypatch, _PACKAGE, files) as root:
        yield root


@pytest.mark.parametrize("how", HOOKS)
def test_a_hook_importing_through_an_alias_is_refused_or_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, package: Path, how: str
) -> None:
    """Refused in one line, or a change to ``GAIN`` serves what the module gives now."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    settings = importlib.import_module(f"{_PACKAGE}.settings")
    module = _hooked(getattr(hooks, how), pre=True)

    def change() -> None:
        monkeypatch.setattr(settings, "GAIN", 3.0)

    try:
        second = _baked_then_reopened(audio_dir, module, tmp_path, change=change, on_miss=None)
    except EncoderLoadError as e:
        assert "\n" not in str(e) and how in str(e)
        return
    _assert_live(second, module, 1)


@pytest.mark.parametrize(
    "how",
    [
        "by_sys_modules",
        "by_sys_modules_get",
        "by_sys_modules_imported_inside",
        "by_sys_modules_from_import",
    ],
)
def test_a_module_taken_out_of_sys_modules_by_a_constant_name_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, package: Path, how: str
) -> None:
    """Read as an import of the module (r14kr.6): not refused, and a change to ``GAIN``
    serves what the encoder gives now."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    settings = importlib.import_module(f"{_PACKAGE}.settings")
    module = _hooked(getattr(hooks, how), pre=True)
    again = _baked_then_reopened(audio_dir, module, tmp_path)
    _assert_live(again, module, 1)  # nothing read changed: the same key, no miss
    monkeypatch.setattr(settings, "GAIN", 3.0)
    second = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")  # a miss encoded
    _assert_live(second, module, 1)


@pytest.mark.parametrize(
    "how",
    [
        "by_sys_modules_name_made_at_run_time",
        "by_sys_modules_get_made_at_run_time",
        "by_sys_modules_values",
    ],
)
def test_a_module_taken_out_of_sys_modules_by_a_name_made_at_run_time_is_refused(
    tmp_path: Path, audio_dir: Path, package: Path, how: str
) -> None:
    """No reading knows which module it reads (r14kr.7): refused in one line, as a name
    made at run time given to ``importlib.import_module`` is."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    module = _hooked(getattr(hooks, how), pre=True)
    assert how in _refusal(audio_dir, module, tmp_path, r"taken out of sys\.modules")


@pytest.mark.parametrize(
    "how", ["by_sys_modules_of_a_library", "by_import_of_a_library", "by_sys_modules_membership"]
)
def test_a_library_taken_out_of_sys_modules_is_read_as_its_import(
    tmp_path: Path, audio_dir: Path, package: Path, how: str
) -> None:
    """``sys.modules["math"]`` is library code, as ``import math`` in a hook is: not refused,
    and its key kept when nothing read changes."""
    hooks = importlib.import_module(f"{_PACKAGE}.hooks")
    module = _hooked(getattr(hooks, how), pre=True)
    again = _baked_then_reopened(audio_dir, module, tmp_path)
    _assert_live(again, module, 1)


# -- what must stay derived: a table made through a decorated function of the user's ---------------

#: A plain settings dict of the user's a table is made from.
TABLE = {"width": 64, "base": 100.0}


@_logged
def _logged_table(n: int) -> torch.Tensor:
    position = torch.arange(0, n, dtype=torch.float32).unsqueeze(1)
    return torch.sin(position / TABLE["base"]).expand(n, TABLE["width"]).clone()


class _TableThroughDecoratedFunction(TinyConvEncoder):
    """A lazy positional table made by a hand-decorated function of the user's from the
    input's length and plain settings only: derived state, found with ``on_miss="error"``."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        if self.pe is None or self.pe.size(0) < x.size(1):
            self.pe = _logged_table(x.size(1)).to(x.device)
        return x + self.pe[: x.size(1)]


def test_a_table_made_through_a_decorated_function_stays_derived(
    tmp_path: Path, audio_dir: Path
) -> None:
    assert "pe" in derived_attributes(_TableThroughDecoratedFunction)
    module = _TableThroughDecoratedFunction().eval()
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)
    _assert_live(second, module, 2)
