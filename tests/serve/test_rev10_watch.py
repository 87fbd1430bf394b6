"""Reproductions of defects left in round ten's keying of what forward hooks hold (serve10.*).

Each test is marked ``xfail(strict=True)``: it fails on the code as it is, for the reason named.
"""

from __future__ import annotations

import fractions
import functools
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.errors import EncoderLoadError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import TinyConvEncoder


def _live(module: torch.nn.Module, path: str) -> torch.Tensor:
    """The module's output for one file, computed now."""
    from featbake.encode.sources import source_for
    from featbake.recipe import Recipe

    with torch.inference_mode():
        return module(source_for(Recipe()).load(Path(path)).unsqueeze(0))[0]


# == one key for one hook in every process ========================================================
_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import torch
from featbake.encode.identity import module_identity
from featbake.testing import TinyConvEncoder
from hookmod import gain

module = TinyConvEncoder().eval()
module.register_forward_pre_hook(gain)
print(module_identity(module).rsplit("hooks:", 1)[1])
"""

_HOOK_MODULE = """
MODE = "serve"


def gain(module, args):
    # a set literal tested with ``in`` is compiled to a frozenset constant of the code object
    factor = 2.0 if MODE in {"train", "eval", "serve", "export", "bake"} else 1.0
    return (args[0] * factor,)
"""


def test_one_hook_is_keyed_alike_in_processes_of_other_hash_seeds(tmp_path: Path) -> None:
    (tmp_path / "hookmod.py").write_text(_HOOK_MODULE)
    script = tmp_path / "ident.py"
    script.write_text(_SCRIPT.format(here=str(tmp_path)))
    repo = str(Path(__file__).resolve().parents[2])
    keys = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": repo}
        out = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
        )
        keys.add(out.stdout.strip())
    assert len(keys) == 1, keys


# == never keyed by type alone ====================================================================
class _PrivateGain:
    """A hook object keeping its setting in a private attribute (ordinary Python style)."""

    def __init__(self, factor: float) -> None:
        self._factor = factor

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self._factor,)


def _scaled_by(factor: Any, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * float(factor),)


_TYPE_ALONE = {
    "private-attribute": _PrivateGain,
    # Fraction (and Path, Decimal's kin in pure Python) keep their value in private slots
    "fraction": lambda f: functools.partial(_scaled_by, fractions.Fraction(f)),
}


@pytest.mark.parametrize("how", list(_TYPE_ALONE))
def test_hooks_whose_values_are_private_attributes_are_served_their_own_features(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(_TYPE_ALONE[how](2))
    b.register_forward_pre_hook(_TYPE_ALONE[how](3))
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


# == ordinary hooks refused =======================================================================
class _LogShapes:
    """A logging hook: it logs each input's shape through a logger's method it holds."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.log("input %s", tuple(args[0].shape))


class _ModuleRef:
    """A hook that keeps a weak reference to the module it watches (no reference cycle)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        assert self.module() is module


def _logger_with_handler() -> Any:
    log = logging.getLogger("rev10.watch.shapes")
    if not log.handlers:
        log.addHandler(logging.NullHandler())  # as logging.basicConfig or any app's setup does
    return log.debug


_ORDINARY = {
    "logger-method": lambda m: _LogShapes(_logger_with_handler()),
    "weakref-to-own-module": _ModuleRef,
}


@pytest.mark.parametrize("how", list(_ORDINARY))
def test_ordinary_observing_hooks_are_served_not_refused(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_ORDINARY[how](module))
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))


# == tensors a module holds in a container ========================================================
class _ListScaled(TinyConvEncoder):
    """TinyConvEncoder's output times a tensor kept in a public list attribute (a bank of
    scales, per-layer constants): no parameter, no buffer, no tensor attribute."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.scales = [torch.tensor(factor)]

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return super().forward(wav) * self.scales[0]


def test_modules_whose_listed_tensors_differ_are_served_their_own_features(
    tmp_path: Path, audio_dir: Path
) -> None:
    a, b = _ListScaled(2.0).eval(), _ListScaled(3.0).eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


# == keys that follow the forwards run ============================================================
class _LazyPositions(TinyConvEncoder):
    """A positional table extended in ``forward`` to the longest input seen (ESPnet's, WeNet's
    and icefall's ``PositionalEncoding.extend_pe``): the same function of the input whatever
    its size, a plain tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None

    def extend_pe(self, n: int) -> None:
        if self.pe is not None and self.pe.size(0) >= n:
            return
        pos = torch.arange(n, dtype=torch.float32)[:, None]
        self.pe = torch.sin(pos / 100.0).expand(n, 64).contiguous()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        self.extend_pe(x.size(1))
        return x + self.pe[: x.size(1)]


class _LastMean:
    """An observing forward hook: it keeps the last output's mean for a progress bar."""

    def __init__(self) -> None:
        self.last_mean: float | None = None

    def __call__(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        self.last_mean = float(output.mean())


def _observed() -> torch.nn.Module:
    module = TinyConvEncoder().eval()
    module.register_forward_hook(_LastMean())
    return module


_FOLLOWING = {"lazy-positional-table": lambda: _LazyPositions().eval(), "last-mean": _observed}


@pytest.mark.parametrize(
    "how",
    [
        "lazy-positional-table",
        "last-mean",
    ],
)
def test_a_second_dataset_after_forwards_finds_the_features_the_first_stored(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    module = _FOLLOWING[how]()
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    first[0]
    first[1]
    first.flush()
    second = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s", on_miss="error")
    torch.testing.assert_close(second[0], _live(module, second.path(0)))


# == a setting rewritten from itself is no counter ================================================
class _Coerced:
    """A hook object that makes its factor a float on each call (a value given as an int, a
    string from a config file): the write reads the name first, as a counter's does."""

    def __init__(self, factor: Any) -> None:
        self.factor = factor

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.factor = float(self.factor)
        return (args[0] * self.factor,)


class _MovedScale:
    """A hook object that moves the tensor it scales by to the input's device on each call
    (``self.scale = self.scale.to(x.device)``, the usual way a hook follows ``.cuda()``)."""

    def __init__(self, factor: float) -> None:
        self.scale = torch.tensor(factor)

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        self.scale = self.scale.to(args[0].device)
        return (args[0] * self.scale,)


_SELF_REWRITTEN = {"coerced-float": _Coerced, "moved-tensor": _MovedScale}


@pytest.mark.parametrize("how", list(_SELF_REWRITTEN))
def test_hooks_that_rewrite_their_setting_from_itself_are_keyed_by_it(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """A setting the hook rewrites from itself and reads for its output is its setting: keyed
    by value (a float), or refused in one line where no key can read it (a held tensor)."""
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(_SELF_REWRITTEN[how](2.0))
    b.register_forward_pre_hook(_SELF_REWRITTEN[how](3.0))
    if how == "moved-tensor":
        with pytest.raises(EncoderLoadError, match="holds scale \\(Tensor\\)") as refused:
            CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
        assert "\n" not in str(refused.value)
        return
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


# == bookkeeping in a method the hook calls =======================================================
class _DelegatingCounter:
    """A hook object whose ``__call__`` hands its input to a method of its own that counts
    (the usual shape of a class with more than one thing to do per call)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.record(args[0])

    def record(self, x: torch.Tensor) -> None:
        self.count += 1


def test_a_counter_in_a_method_the_hook_calls_leaves_the_datasets_misses_served(
    tmp_path: Path, audio_dir: Path
) -> None:
    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_DelegatingCounter())
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    ds[0]
    with torch.no_grad():
        module(torch.zeros(1, 8000))  # the user's own forward
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))


# == a dict's order is part of its value ==========================================================
def _mul(factor: float, x: torch.Tensor) -> torch.Tensor:
    return x * factor


def _add(shift: float, x: torch.Tensor) -> torch.Tensor:
    return x + shift


def _pipeline(steps: dict[str, Any]) -> Any:
    """A pre-hook running the steps of a dict in its order (a dict keeps insertion order)."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        for step in steps.values():
            x = step(x)
        return (x,)

    return hook


def test_hooks_whose_dicts_differ_in_order_only_are_served_their_own_features(
    tmp_path: Path, audio_dir: Path
) -> None:
    scale, shift = functools.partial(_mul, 2.0), functools.partial(_add, 1.0)
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(_pipeline({"scale": scale, "shift": shift}))
    b.register_forward_pre_hook(_pipeline({"shift": shift, "scale": scale}))
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


# == hooks a library installs at the first forward ================================================
class _HiddenLayer(torch.nn.Module):
    """A tiny transformers Wav2Vec2Model (random weights, built from a config) whose second
    hidden state is the feature: ``output_hidden_states=True``, the usual way to take a layer."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        config = Wav2Vec2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            conv_dim=(16, 16),
            conv_stride=(5, 4),
            conv_kernel=(10, 8),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
        )
        torch.manual_seed(0)
        self.w2v = Wav2Vec2Model(config)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.w2v(wav, output_hidden_states=True).hidden_states[1]


def test_a_transformers_models_key_does_not_follow_its_first_forward(
    tmp_path: Path, audio_dir: Path
) -> None:
    pytest.importorskip("transformers")
    module = _HiddenLayer().eval()
    for p in module.parameters():
        p.requires_grad_(False)
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s", on_miss="error")
    torch.testing.assert_close(second[0], _live(module, second.path(0)))


# == what a hook reads from its module's globals ==================================================
#: A script's settings, as ``args = parser.parse_args()`` at module level gives them: each run of
#: the script with other command-line values has other settings, from the same source file.
_SETTINGS = {"gain": 2.0}


def _gain_from_settings(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * _SETTINGS["gain"],)


def test_a_hook_reading_a_script_setting_is_keyed_by_its_value(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = TinyConvEncoder().eval()
    a.register_forward_pre_hook(_gain_from_settings)
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    monkeypatch.setitem(_SETTINGS, "gain", 3.0)  # the next run of the script, with --gain 3
    b = TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    b.register_forward_pre_hook(_gain_from_settings)
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


# == containers read by their repr ================================================================
def test_a_tensor_inside_a_deque_a_hook_holds_is_refused_as_inside_a_list() -> None:
    import collections

    from featbake.encode.identity import held_refusals

    gains = torch.ones(2000)
    hook = functools.partial(_scaled_by, collections.deque([gains]))
    assert held_refusals(hook), "a tensor inside a deque was neither refused nor keyed"
