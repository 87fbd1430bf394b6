"""A second review of what the watch over an in-process encoder keys, after the fixes of round
twelve's review (r12.1-r12.12): each test is a gap that review found, failing on the code it
reviewed (docs/reliability.md, "Round twelve: second review of what hooks reach")."""

from __future__ import annotations

import functools
import multiprocessing
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.serve.dataset import CachedFeatureDataset
from tests.serve.test_watch_keys import _assert_live, _first_dataset, _hooked
from tests.serve.test_watch_keys_review import _served_after_change

THIS_MODULE = sys.modules[__name__]  # as ``import config`` of a user's own module


# -- the user's code under a library decorator -----------------------------------------------------

#: Settings the user's decorated code reads.
DECORATED_SETTINGS = {"gain": 2.0}


@torch.no_grad()
def _scaled_by(x: torch.Tensor, key: str) -> torch.Tensor:
    return x * DECORATED_SETTINGS[key]


#: ``partial`` of the user's ``@torch.no_grad()`` function: the wrapper is torch's code.
DECORATED_GAIN = functools.partial(_scaled_by, key="gain")


def _through_decorated_partial(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (DECORATED_GAIN(args[0]),)


class _DecoratedNormaliser:
    """A helper object and transform whose methods are ``@torch.no_grad()``."""

    @torch.no_grad()
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * DECORATED_SETTINGS["gain"]

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * DECORATED_SETTINGS["gain"]


DECORATED_NORMALISER = _DecoratedNormaliser()


def _through_decorated_method(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (DECORATED_NORMALISER.apply(args[0]),)


def _through_decorated_call(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (DECORATED_NORMALISER(args[0]),)


class _DecoratedHook:
    """A hook object whose ``__call__`` is ``@torch.no_grad()``."""

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * DECORATED_SETTINGS["gain"],)


@pytest.mark.parametrize("held", ["partial", "method", "transform", "hook-object"])
def test_the_users_decorated_code_is_keyed_by_what_it_reads(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    hooks = {
        "partial": _through_decorated_partial,
        "method": _through_decorated_method,
        "transform": _through_decorated_call,
        "hook-object": _DecoratedHook(),
    }
    _served_after_change(
        tmp_path,
        audio_dir,
        hooks[held],
        lambda: monkeypatch.setitem(DECORATED_SETTINGS, "gain", 3.0),
    )


# -- an event a hook branches on ------------------------------------------------------------------

#: A switch a training loop's thread sets: the hook passes the output through while it is set.
BYPASS = threading.Event()


def _bypassable(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    if BYPASS.is_set():
        return output
    return output * 2.0


def test_a_hook_branching_on_an_event_is_keyed_by_its_flag(tmp_path: Path, audio_dir: Path) -> None:
    try:
        _served_after_change(tmp_path, audio_dir, _bypassable, BYPASS.set, pre=False)
    finally:
        BYPASS.clear()


# -- streaming state read outside the code recorded_attributes reads -------------------------------


class _StreamingByName(torch.nn.Module):
    """A streaming module whose output adds the mean of its past forwards' means, its states
    read by name (``getattr(self, name)`` over the names it keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(1, 4, 3)
        self.past: list[torch.Tensor] = []

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = self.conv(wav.unsqueeze(1))
        self.past.append(out.detach().mean())
        context = [torch.stack(getattr(self, name)).mean() for name in ("past",)]
        return out + context[0]


def _context_of(module: Any) -> torch.Tensor:
    return torch.stack(module.past).mean()


class _StreamingByHelper(_StreamingByName):
    """The same, its past read by a module-level helper it passes itself to."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = self.conv(wav.unsqueeze(1))
        self.past.append(out.detach().mean())
        return out + _context_of(self)


@pytest.mark.parametrize("cls", [_StreamingByName, _StreamingByHelper], ids=["getattr", "helper"])
def test_streaming_state_read_outside_the_forward_stays_keyed(cls: type) -> None:
    from featbake.keys import derived_attributes

    assert "past" not in derived_attributes(cls)


# -- a class attribute read through self ----------------------------------------------------------


class _ClassScaled:
    """A hook object whose setting is a class attribute (``scale = 2.0``), read as
    ``self.scale``."""

    scale = 2.0

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.scale,)


CLASS_SCALED = _ClassScaled()


class _ClassGained:
    """A transform object run by a hook, its gain a class attribute."""

    gain = 2.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


CLASS_GAINED = _ClassGained()


class _ClassConfig:
    """Settings as class attributes, applied by a class method (``cls.GAIN``)."""

    GAIN = 2.0

    @classmethod
    def apply(cls, x: torch.Tensor) -> torch.Tensor:
        return x * cls.GAIN


def _through_class_method(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (_ClassConfig.apply(args[0]),)


def _through_class_gained(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (CLASS_GAINED(args[0]),)


@pytest.mark.parametrize("held", ["hook-object", "transform", "class-method"])
def test_a_class_attribute_read_through_self_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    if held == "hook-object":
        hook: Any = CLASS_SCALED
        change = lambda: monkeypatch.setattr(_ClassScaled, "scale", 3.0)  # noqa: E731
    elif held == "transform":
        hook = _through_class_gained
        change = lambda: monkeypatch.setattr(_ClassGained, "gain", 3.0)  # noqa: E731
    else:
        hook = _through_class_method
        change = lambda: monkeypatch.setattr(_ClassConfig, "GAIN", 3.0)  # noqa: E731
    _served_after_change(tmp_path, audio_dir, hook, change)


# -- a global bound method of a module ------------------------------------------------------------

#: A projection's forward, held as a bound method (``embed = model.get_features``).
PROJECT = torch.nn.Linear(64, 64).forward


def _projected(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return output + PROJECT(output)


def test_a_global_bound_method_of_a_module_is_keyed_by_the_modules_state(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = torch.nn.Linear(64, 64)  # the next run's checkpoint
    _served_after_change(
        tmp_path,
        audio_dir,
        _projected,
        lambda: monkeypatch.setattr(THIS_MODULE, "PROJECT", other.forward),
        pre=False,
    )


# -- a setting of the user's module read by getattr ------------------------------------------------

MODULE_GAIN = 2.0


def _through_getattr(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * getattr(THIS_MODULE, "MODULE_GAIN", 1.0),)


def test_a_setting_of_the_users_module_read_by_getattr_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        _through_getattr,
        lambda: monkeypatch.setattr(THIS_MODULE, "MODULE_GAIN", 3.0),
    )


# -- a cached property a hook reads --------------------------------------------------------------


class _Windowed:
    """A helper object whose window is made at first use (``functools.cached_property``)."""

    def __init__(self) -> None:
        self.length = 3

    @functools.cached_property
    def window(self) -> torch.Tensor:
        return torch.hann_window(self.length, periodic=False)


WINDOWED = _Windowed()


def _through_cached_property(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * WINDOWED.window.max(),)


def test_a_cached_property_made_at_the_first_forward_is_no_change(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _hooked(_through_cached_property, pre=True)
    ds = _first_dataset(audio_dir, module, tmp_path)
    ds[0]
    _assert_live(ds, module, 2)


# -- a setting reached through a namespace package ------------------------------------------------

#: ``import configs.audio`` where ``configs/`` has no ``__init__.py`` (as ``tests/`` here).
CONFIGS: Any = None


def _through_namespace_package(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * CONFIGS.audio.GAIN,)


def test_a_setting_reached_through_a_namespace_package_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    package = tmp_path / "code" / "review2_configs"
    package.mkdir(parents=True)
    (package / "audio.py").write_text("GAIN = 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    try:
        audio = importlib.import_module("review2_configs.audio")
        monkeypatch.setattr(THIS_MODULE, "CONFIGS", sys.modules["review2_configs"])
        _served_after_change(
            tmp_path,
            audio_dir,
            _through_namespace_package,
            lambda: monkeypatch.setattr(audio, "GAIN", 3.0),
        )
    finally:
        sys.modules.pop("review2_configs.audio", None)
        sys.modules.pop("review2_configs", None)


# -- a recorder holding a multiprocessing lock ----------------------------------------------------


class _ProcessRecorder:
    """A metrics recorder shared with DataLoader workers: a ``multiprocessing`` lock."""

    def __init__(self) -> None:
        self.lock = multiprocessing.get_context("spawn").Lock()
        self.values: list[float] = []

    def __call__(self, value: float) -> None:
        with self.lock:
            self.values.append(value)


PROCESS_RECORDER = _ProcessRecorder()


def _record_mean_across_processes(
    module: torch.nn.Module, args: tuple[Any, ...], output: Any
) -> None:
    PROCESS_RECORDER(float(output.mean()))


def test_an_observing_hook_calling_a_recorder_with_a_process_lock_is_served(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _hooked(_record_mean_across_processes)
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    _assert_live(ds, module, 1)
