"""Review of serve9.13-serve9.15: what a forward hook holds that is neither plain nor a
top-level tensor is keyed by its type alone, so hooks that differ only there share keys."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featbake.serve.cached_encoder import CachedEncoder
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import TinyConvEncoder


def _times(value: Any) -> Any:
    """A pre-hook scaling its input by what ``value`` says (read at each call)."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if isinstance(value, dict):
            factor = value["factor"]
        elif isinstance(value, tuple):
            factor = value[0]
        elif callable(value):
            factor = value(1.0)
        else:
            factor = value
        return (args[0] * factor,)

    return hook


@dataclasses.dataclass(slots=True)
class _SlottedScaler:
    """A hook object with ``__slots__`` (``dataclass(slots=True)``, ``attrs.define``)."""

    factor: float

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.factor,)


_HOLDING = {
    "numpy-scalar": lambda f: _times(np.float32(f)),
    "dict": lambda f: _times({"factor": f}),
    "callable": lambda f: _times(lambda x: x * f),
    "slotted-object": _SlottedScaler,
}


def test_a_hook_holding_a_tensor_inside_a_tuple_is_refused_in_one_line(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A tensor is refused wherever in what a hook holds it is (here inside a tuple), as
    serve9.15 refuses one held at the top: no key reads its values."""
    from featbake.errors import EncoderLoadError

    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_times((torch.tensor(2.0),)))
    with (
        pytest.warns(UserWarning, match="no featbake store"),
        pytest.raises(EncoderLoadError, match=r"holds a value \(Tensor\).*buffer") as e,
    ):
        CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    assert "\n" not in str(e.value)


def _live(module: torch.nn.Module, path: str) -> torch.Tensor:
    from featbake.encode.sources import source_for
    from featbake.recipe import Recipe

    with torch.inference_mode():
        return module(source_for(Recipe()).load(Path(path)).unsqueeze(0))[0]


@pytest.mark.parametrize("how", list(_HOLDING))
def test_modules_whose_hooks_hold_other_non_plain_values_are_served_their_own_features(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(_HOLDING[how](2.0))
    b.register_forward_pre_hook(_HOLDING[how](3.0))
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


def test_a_hooks_dict_edited_in_place_is_not_served_stale_by_cached_encoder() -> None:
    module = TinyConvEncoder().eval()
    for p in module.parameters():
        p.requires_grad_(False)
    config = {"factor": 2.0}
    module.register_forward_pre_hook(_times(config))
    cached = CachedEncoder(module, cache=None)
    x = torch.randn(2, 8000, generator=torch.Generator().manual_seed(0))
    cached(x, ids=["a", "b"])
    config["factor"] = 3.0
    with torch.no_grad():
        now = module(x)
    torch.testing.assert_close(cached(x, ids=["a", "b"]), now)


class _LazyGain:
    """A hook object that sets its factor's default on its first call (a lazy default): its
    ``__call__`` writes ``self.factor``, which serve9.13 reads as its bookkeeping."""

    def __init__(self, factor: float | None) -> None:
        self.factor = factor

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.factor is None:
            self.factor = 1.0
        return (args[0] * self.factor,)


def _lazy_closure(factor: float | None) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        nonlocal factor
        if factor is None:
            factor = 1.0
        return (args[0] * factor,)

    return hook


_LAZY = {"object-attribute": _LazyGain, "closure-cell": _lazy_closure}


@pytest.mark.parametrize("how", list(_LAZY))
def test_hooks_that_write_their_factor_lazily_are_keyed_by_it(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(_LAZY[how](2.0))
    b.register_forward_pre_hook(_LAZY[how](3.0))
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


def _doubled_output(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    return out * 2.0 if isinstance(module, TinyConvEncoder) else None


def test_a_global_hook_registered_before_the_dataset_is_made_is_not_served_stale(
    tmp_path: Path, audio_dir: Path
) -> None:
    from torch.nn.modules import module as torch_module

    module = TinyConvEncoder().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        plain = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    plain[0]
    plain.flush()
    handle = torch_module.register_module_forward_hook(_doubled_output)
    try:
        hooked = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
        torch.testing.assert_close(hooked[0], _live(module, hooked.path(0)))
    finally:
        handle.remove()


_DECORATED = """import torch


@torch.no_grad()
def pre(module, args):
    return (args[0] * FACTOR,)
"""


def test_a_decorated_hook_edited_is_keyed_by_its_new_body(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    folder = tmp_path / "pkg"
    folder.mkdir()
    source = folder / "review10_decorated_hooks.py"
    source.write_text(_DECORATED.replace("FACTOR", "2.0"))
    monkeypatch.syspath_prepend(str(folder))
    hooks = importlib.import_module("review10_decorated_hooks")
    a = TinyConvEncoder().eval()
    a.register_forward_pre_hook(hooks.pre)
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    source.write_text(_DECORATED.replace("FACTOR", "3.0"))  # the user edits the hook
    hooks = importlib.reload(hooks)
    b = TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    b.register_forward_pre_hook(hooks.pre)
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


class _Adapter(torch.nn.Module):
    """Another module (an adapter, a probe) whose bound method is the encoder's pre-hook: its
    output depends on the adapter's own parameter."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(gain), requires_grad=False)

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.gain,)


def test_a_hook_bound_to_another_modules_method_is_keyed_by_its_weights_or_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    from featbake.errors import EncoderLoadError

    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    adapters = (_Adapter(2.0), _Adapter(3.0))
    a.register_forward_pre_hook(adapters[0].pre)
    b.register_forward_pre_hook(adapters[1].pre)
    try:
        with pytest.warns(UserWarning, match="no featbake store"):
            first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
        first[0]
        first.flush()
        second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    except EncoderLoadError:
        return  # refused in one line: no stale feature
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


class _NormLog:
    """A logging pre-hook object that records each input's norm in a list it holds."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.norms.append(round(float(args[0].norm()), 3))


def _counting_list_closure() -> Any:
    calls = [0]

    def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        calls[0] += 1

    return pre


_RECORDING = {"appending-object": _NormLog, "list-cell": _counting_list_closure}


@pytest.mark.parametrize("how", list(_RECORDING))
def test_a_recording_hooks_key_does_not_follow_what_it_recorded(how: str) -> None:
    from featbake.encode.identity import module_identity

    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_RECORDING[how]())
    before = module_identity(module)
    with torch.no_grad():
        module(torch.zeros(1, 8000))
    assert module_identity(module) == before


@pytest.mark.parametrize("how", list(_RECORDING))
def test_a_recording_hook_leaves_the_datasets_misses_served(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_RECORDING[how]())
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    ds[0]
    with torch.no_grad():
        module(torch.zeros(1, 8000))  # the user's own forward
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))


class _TensorScaled(torch.nn.Module):
    """TinyConvEncoder's output times a tensor attribute that is no parameter or buffer."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.inner = TinyConvEncoder()
        self.scale = torch.tensor(scale)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.inner(wav) * self.scale


def test_modules_whose_tensor_attributes_differ_are_served_their_own_features_or_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    from featbake.errors import EncoderLoadError

    a, b = _TensorScaled(2.0).eval(), _TensorScaled(3.0).eval()
    b.inner.load_state_dict(a.inner.state_dict())
    try:
        with pytest.warns(UserWarning, match="no featbake store"):
            first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
        first[0]
        first.flush()
        second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    except EncoderLoadError:
        return  # refused in one line, as a hook holding it is
    torch.testing.assert_close(second[0], _live(b, second.path(0)))
