"""A review of what the watch over an in-process encoder keys, as widened in round twelve
(serve12.1-serve12.8): each test is a gap the review found, failing on the code it reviewed
(docs/reliability.md, "Round twelve: review of what hooks reach"); the one strict xfail left is
a gap still open, failing for the reason it names."""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featbake.errors import CacheMiss, EncoderLoadError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import TinyConvEncoder
from tests.serve.test_watch_keys import _assert_live, _first_dataset, _hooked

THIS_MODULE = sys.modules[__name__]  # as ``import shared`` of a user's own module


def _second_run(a: torch.nn.Module, hook: Any, *, pre: bool) -> torch.nn.Module:
    """The next run's module: ``a``'s weights, ``hook`` registered again."""
    b = TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    (b.register_forward_pre_hook if pre else b.register_forward_hook)(hook)
    return b


def _served_after_change(
    tmp_path: Path, audio_dir: Path, hook: Any, change: Any, *, pre: bool = True
) -> None:
    """A first dataset over ``hook``, then ``change()`` (the next run's setting), then a second
    dataset on the same store: it must serve what the module gives now."""
    a = _hooked(hook, pre=pre)
    first = _first_dataset(audio_dir, a, tmp_path)
    first[0]
    first.flush()
    change()
    b = _second_run(a, hook, pre=pre)
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    _assert_live(second, b, 1)


# -- a partial of a library function: its arguments are settings -----------------------------------

#: ``functools.partial(F.normalize, p=2.0, dim=1)``: the library's function, the user's settings.
NORMALISE = functools.partial(torch.nn.functional.normalize, p=2.0, dim=1)


def _normalised(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return NORMALISE(output)


def test_a_partial_of_a_library_function_is_keyed_by_its_arguments(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def change() -> None:
        partial = functools.partial(torch.nn.functional.normalize, p=1.0, dim=1)
        monkeypatch.setattr(THIS_MODULE, "NORMALISE", partial)

    _served_after_change(tmp_path, audio_dir, _normalised, change, pre=False)


# -- a class's default read through its instance ---------------------------------------------------


class _Defaults:
    """Settings as class-level defaults, read through an instance (``cfg = Config()``)."""

    gain = 2.0


DEFAULTS = _Defaults()


def _gain_from_instance(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * DEFAULTS.gain,)


def test_a_class_default_read_through_an_instance_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        _gain_from_instance,
        lambda: monkeypatch.setattr(_Defaults, "gain", 3.0),
    )


# -- methods of the user's own objects -------------------------------------------------------------

#: Settings read by a method of the user's class, not by ``__call__`` itself.
METHOD_SETTINGS = {"gain": 2.0}


class _Normaliser:
    """A helper object with methods (``normaliser.apply(x)``), and a transform whose
    ``__call__`` hands the work to another method (``self._scale(x)``)."""

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * METHOD_SETTINGS["gain"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._scale(x)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * METHOD_SETTINGS["gain"]


NORMALISER = _Normaliser()


def _through_instance_method(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (NORMALISER.apply(args[0]),)


def _through_call_delegating(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (NORMALISER(args[0]),)


def test_a_setting_read_by_a_method_of_a_global_object_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        _through_instance_method,
        lambda: monkeypatch.setitem(METHOD_SETTINGS, "gain", 3.0),
    )


def test_a_setting_read_by_a_method_a_callable_object_calls_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        _through_call_delegating,
        lambda: monkeypatch.setitem(METHOD_SETTINGS, "gain", 3.0),
    )


# -- a class of a notebook cell, or of ``python -c`` -----------------------------------------------

_CELL = """
class Config:
    GAIN = 2.0


def hook(module, args):
    return (args[0] * Config.GAIN,)
"""


def _notebook(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A notebook's namespace: a module with no ``__file__`` (Jupyter's, ``python -c``'s
    ``__main__``), whose cell defines a settings class and a hook reading it."""
    cell = types.ModuleType("featbake_review_notebook")
    monkeypatch.setitem(sys.modules, cell.__name__, cell)
    exec(compile(_CELL, "<ipython-input-1>", "exec"), cell.__dict__)
    return cell


def test_a_setting_of_a_class_defined_in_a_notebook_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cell = _notebook(monkeypatch)
    _served_after_change(
        tmp_path, audio_dir, cell.hook, lambda: monkeypatch.setattr(cell.Config, "GAIN", 3.0)
    )


# -- a log kept in the user's own module -----------------------------------------------------------

#: A dict of activations a hook fills, kept in a module of the user's (``shared.ACTIVATION``).
ACTIVATION: dict[str, Any] = {}


def _capture_in_module(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    THIS_MODULE.ACTIVATION["out"] = output.detach()


def test_a_hook_filling_a_dict_of_a_user_module_is_served(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(THIS_MODULE, "ACTIVATION", {})
    module = _hooked(_capture_in_module)
    ds = _first_dataset(audio_dir, module, tmp_path)
    _assert_live(ds, module, 3)


# -- the forum's get_activation(name) --------------------------------------------------------------

#: The PyTorch forum's hook factory: ``activation[name] = output.detach()``, ``name`` a cell.
NAMED_ACTIVATION: dict[str, Any] = {}


def _get_activation(name: str) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        NAMED_ACTIVATION[name] = output.detach()

    return hook


def test_the_forums_get_activation_hook_is_served(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(THIS_MODULE, "NAMED_ACTIVATION", {})
    module = _hooked(_get_activation("encoder"))
    ds = _first_dataset(audio_dir, module, tmp_path)
    _assert_live(ds, module, 3)


# -- a callable object of the user's holding a lock ------------------------------------------------


class _Recorder:
    """A thread-safe metrics recorder (a logging thread drains ``values``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.values: list[float] = []

    def __call__(self, value: float) -> None:
        with self.lock:
            self.values.append(value)


RECORDER = _Recorder()


def _record_mean(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    RECORDER(float(output.mean()))


def test_an_observing_hook_calling_a_recorder_with_a_lock_is_served(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _hooked(_record_mean)
    ds = _first_dataset(audio_dir, module, tmp_path)
    _assert_live(ds, module, 1)


# -- a global sparse tensor ------------------------------------------------------------------------

#: A sparse projection a hook applies (a sparse filter bank, a graph's adjacency).
SPARSE_PROJECTION = (torch.eye(64) * 2.0).to_sparse()


def _sparse_projected(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    return output @ SPARSE_PROJECTION.to_dense()


def test_a_global_sparse_tensor_is_keyed_or_refused_in_one_line(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = _hooked(_sparse_projected)
    try:
        ds = _first_dataset(audio_dir, module, tmp_path)
        ds[0]
    except EncoderLoadError as e:
        assert "\n" not in str(e)


# -- a callable object of the user's that only observes --------------------------------------------


class _Elapsed:
    """A logging helper object: logs each forward with the time since the run began."""

    def __init__(self) -> None:
        self.log = logging.getLogger("train")
        self.started = time.monotonic()

    def __call__(self, what: str) -> None:
        self.log.debug("%s at %.1f s", what, time.monotonic() - self.started)


ELAPSED = _Elapsed()


def _log_forward(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    ELAPSED("forward")


@pytest.mark.xfail(
    strict=True,
    raises=CacheMiss,
    reason="a global logging object of the user's is now followed and keyed by its attributes: "
    "its start time differs in each run, so the next run's keys find none of the features "
    "stored, where before serve12.1 the object was code and the run found them",
)
def test_an_observing_hook_calling_a_logging_object_keeps_its_key(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _hooked(_log_forward)
    first = _first_dataset(audio_dir, a, tmp_path)
    first[0]
    first.flush()
    monkeypatch.setattr(THIS_MODULE, "ELAPSED", _Elapsed())  # the next run's, started later
    ELAPSED.started += 12.5
    b = _second_run(a, _log_forward, pre=False)
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s", on_miss="error")
    _assert_live(second, b, 1)


# -- streaming state read through a property -------------------------------------------------------


class _StreamingByProperty(torch.nn.Module):
    """TinyConvEncoder whose output adds the mean of the past forwards' means (streaming
    state), read through a property (``self.context``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyConvEncoder()
        self.past: list[torch.Tensor] = []

    @property
    def context(self) -> torch.Tensor:
        return torch.stack(self.past).mean()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = self.inner(wav)
        self.past.append(out.detach().mean())
        return out + self.context


def test_streaming_state_read_through_a_property_stays_keyed() -> None:
    from featbake.keys import derived_attributes, tensor_attributes

    assert "past" not in derived_attributes(_StreamingByProperty)
    module = _StreamingByProperty().eval()
    before = len(tensor_attributes(module))
    with torch.inference_mode():
        module(torch.randn(1, 8000))
    assert len(tensor_attributes(module)) == before + 1  # the past, keyed by value


# -- cost: library calls read again at each forward ------------------------------------------------


def _library_calls(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    out = torch.nn.functional.gelu(torch.nn.functional.relu(output))
    out = torch.nn.functional.normalize(out, dim=1) + torch.sigmoid(out)
    return torch.nn.functional.layer_norm(out, out.shape[-1:]) * np.float32(1.0)


def test_a_hook_calling_library_functions_reads_no_namespace_again_at_each_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import inspect

    import featbake.encode.identity as identity

    first = identity.held_values(_library_calls)  # what is made once per code object
    reads: list[str] = []
    own, static = identity.is_own_namespace, inspect.getattr_static

    def counted_own(value: Any) -> bool:
        reads.append(f"is_own_namespace({getattr(value, '__name__', value)})")
        return own(value)

    def counted_static(obj: Any, attr: str, *default: Any) -> Any:
        reads.append(f"getattr_static({type(obj).__name__}, {attr})")
        return static(obj, attr, *default)

    monkeypatch.setattr(identity, "is_own_namespace", counted_own)
    monkeypatch.setattr(inspect, "getattr_static", counted_static)
    assert identity.held_values(_library_calls) == first
    assert reads == []
