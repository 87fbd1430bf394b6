"""What watching an in-process encoder costs the user's own forward, and a batch of misses.

A module handed to a dataset (``CachedFeatureDataset(data, module)``) is watched so that a miss
is never encoded with it once it changed (:func:`featbake.serve.cached_encoder.shared_watch`).
The watch follows every run of the module, whoever calls it, so what a run changes in the module
itself is bookkeeping: that costs each forward the user runs (a teacher also run in the training
step pays it every step). Measured here side by side in one run, forwards alternated: the bare
module, and a copy of it watched as a dataset watches it; then the check a batch of misses makes
before it runs (``LiveEncoder.refuse_changed``: train mode, versions, pointers, weight probe,
attributes), the run itself left out. One torch thread.

Models: a 24-layer MLP (width 512, batch 8), the same MLP counting its calls (``self.calls += 1``
in its forward: a run that sets a plain attribute, which the hooks trust from the glance) and,
where ``transformers`` is installed, a wav2vec2-base sized model
(``Wav2Vec2Model(Wav2Vec2Config())``, 94M parameters) on 0.1 s of audio; the MLP with user
hooks whose settings the watch reads at each forward (a pre-hook calling a helper that reads a
config by key and a parsed ``args`` by field, a forward hook running a global adapter and a
global window), bare and watched both running those hooks; and the MLP whose own forward reads
the config, ``args`` and window the same way.

Run: ``chrt -f 10 python benchmarks/bench_watch.py [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _rows import row

from featbake.serve.cached_encoder import ModuleWatch, shared_watch
from featbake.serve.misses import training_submodule
from featbake.testing import frozen


class Counting(nn.Sequential):
    """An MLP counting its calls in a plain attribute (a module's own bookkeeping)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


#: What a script's user hooks read: a config, parsed args, an adapter and a window (globals).
CONFIG = {f"setting_{i}": float(i) for i in range(150)} | {"gain": 1.0}
ARGS = argparse.Namespace(gain=1.0, lr=1e-3, files=[f"clip{i}.wav" for i in range(600)])
ADAPTER = frozen(nn.Linear(512, 512))
WINDOW = torch.ones(512)


class Configured(nn.Sequential):
    """An MLP whose own forward reads the script's settings (a config by key, ``args`` by
    field, a window), which the watch reads at each forward (``forward_globals``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled(super().forward(x)) * WINDOW


def _scaled(x: torch.Tensor) -> torch.Tensor:
    return x * CONFIG["gain"] * ARGS.gain


def _scale_input(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (_scaled(args[0]),)


def _adapt_output(
    module: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor
) -> torch.Tensor:
    return (y + ADAPTER(y)) * WINDOW


def _hooked_mlp() -> nn.Module:
    module = _mlp(nn.Sequential)
    module.register_forward_pre_hook(_scale_input)
    module.register_forward_hook(_adapt_output)
    return module


def _mlp(cls: type[nn.Sequential]) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    return frozen(cls(*layers))


def _models() -> list[tuple[str, nn.Module, torch.Tensor]]:
    x = torch.randn(8, 512)
    models = [("24-layer MLP", _mlp(nn.Sequential), x), ("counting MLP", _mlp(Counting), x)]
    models.append(("MLP with user hooks", _hooked_mlp(), x))
    models.append(("MLP whose forward reads settings", _mlp(Configured), x))
    try:
        from transformers import Wav2Vec2Config, Wav2Vec2Model
    except ImportError:
        return models
    w2v = frozen(Wav2Vec2Model(Wav2Vec2Config()))
    return [*models, ("wav2vec2-base sized", w2v, torch.randn(1, 1600))]


def _ms(fn: Callable[[], object], repeat: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e3


def _side_by_side(bare: nn.Module, watched: nn.Module, x: torch.Tensor, rounds: int) -> tuple:
    """Median ms per forward of each, the two alternated ``rounds`` times."""
    a, b = [], []
    with torch.no_grad():
        for _ in range(rounds):
            a.append(_ms(lambda: bare(x), 10))
            b.append(_ms(lambda: watched(x), 10))
    return statistics.median(a), statistics.median(b)


def _watch_hooks(hooks: dict) -> list:
    """The watch's own hooks of a module's hook dict (the user's left out: bare runs them too)."""
    return [h for h in hooks.values() if getattr(h, "featbake_bookkeeping", False)]


def main(quick: bool = False) -> list[dict]:
    torch.set_num_threads(1)
    rounds = 5 if quick else 30
    rows = []
    for name, bare, x in _models():
        module = copy.deepcopy(bare)
        watch = shared_watch(module)
        watch.fingerprint()  # as a dataset made over it trusts it
        with torch.no_grad():
            bare(x), module(x)  # warm
        plain, hooked = _side_by_side(bare, module, x, rounds)

        def check(module: nn.Module = module, watch: ModuleWatch = watch) -> None:
            assert training_submodule(module) is None
            watch.fingerprint()

        with torch.no_grad():
            y = module(x)
        pre = _watch_hooks(module._forward_pre_hooks)  # what torch runs around a forward
        post = _watch_hooks(module._forward_hooks)

        def hooks(module: nn.Module = module, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            for hook in pre:  # noqa: B023 - called here, in this iteration only
                hook(module, (x,))
            if isinstance(module, Counting):
                module.calls += 1  # what its forward does between the hooks
            for hook in post:  # noqa: B023
                hook(module, (x,), y)

        alone = statistics.median(_ms(hooks, 20) for _ in range(rounds))
        per_miss = statistics.median(_ms(check, 3) for _ in range(rounds // 3 or 1))
        note = f"bare forward {plain:.3f} ms, watched {hooked:.3f} ms (median of {rounds} x 10)"
        rows += [
            row("watch", f"{name}: watched minus bare forward", hooked - plain, "ms", note=note),
            row("watch", f"{name}: the watch's hooks per forward", alone, "ms"),
            row("watch", f"{name}: change check per batch of misses", per_miss, "ms"),
        ]
    return rows


if __name__ == "__main__":
    for r in main(quick="--quick" in sys.argv):
        print(f"{r['metric']}: {r['value']:,.3f} {r['unit']}  {r['note']}")
