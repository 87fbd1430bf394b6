"""The globals an in-process module's own forward reads (r24.1): ``x * shared.STATE.scale``,
a helper of another module reading a settings dict, a global tensor, a global of the
module's own file, one read by a method the forward calls or by a submodule of the user's.
Each was keyed by nothing (a module's forward hooks' globals were, serve10.17), so a dataset
made after a change, or a ``CachedEncoder`` after one, served the features of the setting
first run. Each test changes one and compares what is served with the encoder run now; the
reverse tests check that a forward recording into globals, or reading none, keeps its key."""

from __future__ import annotations

import functools
import importlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from featbake.encode.encoders import from_module
from featbake.encode.identity import forward_globals, module_identity
from featbake.serve.cached_encoder import CachedEncoder
from featbake.testing import TinyConvEncoder
from tests.serve.test_cached_encoder import frozen, waves
from tests.serve.test_held_attributes import (
    assert_a_second_pass_hits,
    served_live_by_an_open_cached_encoder,
)
from tests.serve.test_watch_keys import (
    _assert_live,
    _baked_then_reopened,
    _first_dataset,
    _refused_in_one_line,
    _served_live_after,
    _user_package,
)

_PACKAGE = "fwdglobals"

_SHARED = """
import functools
import types
import numpy as np
import torch

STATE = types.SimpleNamespace(scale=2.0)
GAIN = {"g": 1.0}
WINDOW = torch.tensor([2.0, 1.0])
ARRAY = np.array([2.0, 1.0])
MONITOR = types.SimpleNamespace(last=None)
STATS = types.SimpleNamespace(calls=0, total=0.0)
SEEN = []


def gained(x):
    return x * GAIN["g"]


CACHED = {"g": 1.0}


@functools.lru_cache
def cached_gain():
    return CACHED["g"]


def apply_it(m, x):
    return m.scale_it(x)


from torch.nn.functional import gelu  # noqa: E402
from featbake.testing import TinyConvEncoder  # noqa: E402


class PicksAHelperByName(TinyConvEncoder):
    helper = "gained"

    def forward(self, wav):
        return globals()[self.helper](super().forward(wav))
"""

_MODEL = """
import functools
import types
import torch
from featbake.testing import TinyConvEncoder
from . import shared
from .shared import gained, PicksAHelperByName  # noqa: F401

SCALE = 2.0
CALLS = 0


class ReadsASetting(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * shared.STATE.scale


class CallsAHelper(TinyConvEncoder):
    def forward(self, wav):
        return gained(super().forward(wav))


class ReadsAWindow(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * shared.WINDOW[0]


class ReadsItsFilesGlobal(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * SCALE


class ScalesInAMethod(TinyConvEncoder):
    def scaled(self, x):
        return x * shared.GAIN["g"]

    def forward(self, wav):
        return self.scaled(super().forward(wav))


class Post(torch.nn.Module):
    def forward(self, x):
        return x * shared.STATE.scale


class HoldsAReader(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.post = Post()

    def forward(self, wav):
        return self.post(super().forward(wav))


class ReadsAClassSetting(TinyConvEncoder):
    SCALE = 2.0
    OPTIONS = {"gain": 1.0}

    def forward(self, wav):
        return super().forward(wav) * self.SCALE * type(self).OPTIONS["gain"]


class CallsACachedHelper(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * shared.cached_gain()


class ReadsAnArray(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * float(shared.ARRAY[0])


class Base(ReadsASetting):
    pass


class ThroughSuper(Base):
    def forward(self, wav):
        return super().forward(wav) + 1.0


EMBEDDINGS = {f"tok{i}": 1.0 for i in range(1000)}


class LooksUpBesideASetting(TinyConvEncoder):
    word = "tok5"

    def forward(self, wav):
        return super().forward(wav) * EMBEDDINGS[self.word] * SCALE


class ScalesInABaseMethod(TinyConvEncoder):
    def scaled(self, x):
        return x * shared.GAIN["g"]

    def forward(self, wav):
        return self.scaled(super().forward(wav))


class OverridesTheMethod(ScalesInABaseMethod):
    def scaled(self, x):
        return super().scaled(x) + 1.0


_warned = False
_WIN = None
WINDOWS = {}
STEP = 0
ACC = torch.zeros(())


class KeepsStateOfItsOwn(TinyConvEncoder):
    def forward(self, wav):
        global _warned, _WIN, STEP
        if not _warned:
            _warned = True
        if _WIN is None:
            _WIN = torch.ones(2)
        key = str(wav.shape[-1])
        if key not in WINDOWS:
            WINDOWS[key] = torch.ones(2)
        STEP += 1
        out = super().forward(wav) * _WIN[0] * WINDOWS[key][0]
        ACC.add_(out.detach().mean())
        return out


ACT = torch.sigmoid
import os  # noqa: E402
from torch.fft import rfft  # noqa: E402
from numpy import abs as npabs  # noqa: E402

TANH = getattr(torch, "tanh")
if os.environ.get("FWD_GLOBALS_TANH"):
    CHOSEN = torch.tanh
else:
    CHOSEN = torch.sigmoid


class CallsAliases(TinyConvEncoder):
    def forward(self, wav):
        y = TANH(super().forward(wav))
        return y + rfft(y, dim=1).abs().mean() + float(npabs(-1.0))


class CallsAChosenActivation(TinyConvEncoder):
    def forward(self, wav):
        return CHOSEN(super().forward(wav))


class CallsALibraryFunctionOfAnotherModule(TinyConvEncoder):
    def forward(self, wav):
        return shared.gelu(super().forward(wav))


class ScalesThroughAHelperOfAnotherModule(TinyConvEncoder):
    def scale_it(self, x):
        return x * shared.STATE.scale

    def forward(self, wav):
        return shared.apply_it(self, super().forward(wav))


def _by_class_setting(m, x):
    return x * m.SCALE


class AHelperReadsAClassSetting(TinyConvEncoder):
    SCALE = 2.0

    def forward(self, wav):
        return _by_class_setting(self, super().forward(wav))


class AsksForAMethod(TinyConvEncoder):
    def scale_it(self, x):
        return x * shared.STATE.scale

    def forward(self, wav):
        return getattr(self, "scale_it")(super().forward(wav))


class AsksAsTheClassSwapsNames(TinyConvEncoder):
    OLD = 1.0

    def forward(self, wav):
        return super().forward(wav) * getattr(self, "K", 1.0)


class PadsThenConvolves(torch.nn.Conv1d):
    def forward(self, x):
        return super().forward(torch.nn.functional.pad(x, (0, 0)))

    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight, bias) * shared.STATE.scale


class HoldsAConvWithAForwardOfItsOwn(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.post = PadsThenConvolves(64, 64, 1)

    def forward(self, wav):
        return self.post(super().forward(wav).transpose(1, 2)).transpose(1, 2)


try:
    from torch.nn.functional import scaled_dot_product_attention
except ImportError:
    scaled_dot_product_attention = None


class AttendsAsWhisperDoes(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.act = torch.nn.functional.silu  # a library function held: as before

    def forward(self, wav):
        y = self.act(super().forward(wav))
        q = y.unsqueeze(1)
        return scaled_dot_product_attention(q, q, q).squeeze(1)


class LogsItsScale(TinyConvEncoder):
    scale = 2.0

    def __init__(self):
        super().__init__()
        self.stats = types.SimpleNamespace(scale=None)

    def forward(self, wav):
        y = super().forward(wav) * self.scale
        self.stats.scale = self.scale  # another object's field, not the class's setting
        return y


class PostProcesses(TinyConvEncoder):
    def post(self, x):
        return x

    def forward(self, wav):
        return self.post(super().forward(wav))


def scaled_post(self, x):
    return x * shared.STATE.scale


class Log:
    scale = None


class LogsOnANamespaceClass(TinyConvEncoder):
    scale = 2.0

    def forward(self, wav):
        Log.scale = self.scale  # another class's field, not this class's setting
        return super().forward(wav) * self.scale


class CountsOnItsClass(TinyConvEncoder):
    calls = 0

    def forward(self, wav):
        type(self).calls += 1
        klass = type(self)
        klass.last_length = wav.shape[-1]
        return super().forward(wav)


class CachesAWindowOnItsClass(TinyConvEncoder):
    _memo = {}

    def forward(self, wav):
        w = getattr(self, "_fb", None)
        if w is None:
            type(self)._fb = torch.hann_window(64)
            w = type(self)._fb
        if 64 not in self._memo:
            self._memo[64] = torch.ones(2)
        return super().forward(wav) * w[10] * self._memo[64][0]


class BindsAnActivation(TinyConvEncoder):
    def forward(self, wav):
        return ACT(super().forward(wav))


class AsksAClassSetting(TinyConvEncoder):
    SCALE = 2.0

    def forward(self, wav):
        return super().forward(wav) * getattr(self, "SCALE", 1.0)


class AsksASettingItMayGain(TinyConvEncoder):
    def forward(self, wav):
        gain = getattr(self, "GAIN", 1.0) if hasattr(self, "GAIN") else 1.0
        return super().forward(wav) * gain


class HoldsAClassWindow(TinyConvEncoder):
    WINDOW = torch.tensor([2.0, 1.0])

    def forward(self, wav):
        return super().forward(wav) * self.WINDOW[0]


def _apply(m, x):
    return m.scale_it(x)


class ScalesThroughAHelperGivenSelf(TinyConvEncoder):
    def scale_it(self, x):
        return x * shared.STATE.scale

    def forward(self, wav):
        return _apply(self, super().forward(wav))


class ScaledConv(torch.nn.Conv1d):
    def _conv_forward(self, input, weight, bias):
        return super()._conv_forward(input, weight, bias) * shared.STATE.scale


class HoldsAnOverridingConv(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.post = ScaledConv(64, 64, 1)

    def forward(self, wav):
        return self.post(super().forward(wav).transpose(1, 2)).transpose(1, 2)


ADAPTER = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.0))


class ReadsAGlobalAdapter(TinyConvEncoder):
    def forward(self, wav):
        return super().forward(wav) * ADAPTER[0].weight.sum().detach()


class PicksAHeadByName(TinyConvEncoder):
    mode = "fast"
    calls = 0

    def forward_fast(self, y):
        return y * shared.STATE.scale

    def forward_slow(self, y):
        return y

    def report(self):
        return f"{self.calls} calls"  # read where no forward runs it: the counter is its own

    def forward(self, wav):
        type(self).calls += 1
        return getattr(self, "forward_" + self.mode)(super().forward(wav))


class PicksAHeadByAnFString(TinyConvEncoder):
    kind = "gain"
    GAIN = 2.0

    def _gain_head(self, y):
        return y * self.GAIN

    def _plain_head(self, y):
        return y

    def forward(self, wav):
        return getattr(type(self), f"_{self.kind}_head")(self, super().forward(wav))


class HasAPartialMethod(TinyConvEncoder):
    def _run(self, wav, scale):
        return super().forward(wav) * scale * shared.STATE.scale

    forward_fast = functools.partialmethod(_run, scale=2.0)

    def forward(self, wav):
        return self.forward_fast(wav)


def timed(fn):
    calls = 0

    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        return fn(*args, **kwargs)

    return wrapper


class WrappedWithoutWraps(TinyConvEncoder):
    @timed
    def forward(self, wav):
        return super().forward(wav) * shared.STATE.scale


class ScalesInItsCall(TinyConvEncoder):
    GAIN = 2.0

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs) * self.GAIN * shared.STATE.scale


OPTIONS = {"gain": 1.0, "bias": 0.0}


class ReadsThroughGlobals(TinyConvEncoder):
    def forward(self, wav):
        if globals().get("LAST_LENGTH") != wav.shape[-1]:  # its own state, read back
            globals()["LAST_LENGTH"] = wav.shape[-1]
        y = super().forward(wav) * globals()["SCALE"] + OPTIONS["bias"]
        return y * globals()["OPTIONS"]["gain"] * globals().get("EXTRA", 1.0)


class WarnsOncePerLength(TinyConvEncoder):
    def forward(self, wav):
        n = wav.shape[-1]
        if not globals().get("_warned_" + str(n)):  # its own state, under names made now
            globals()["_warned_" + str(n)] = True
            globals()[f"STAT_{n}"] = 0
        return super().forward(wav) * SCALE


GAIN2 = 2.0


class PicksAndHasSetters(TinyConvEncoder):
    mode = "fast"
    scale = 2.0

    @classmethod
    def set_scale(cls, s):
        cls.scale = s  # a setting: forward_fast reads it

    def set_gain(self, g):
        global GAIN2
        GAIN2 = g  # a setting: forward_fast reads it

    def describe(self):
        import os
        import sys

        return sys.argv, os.environ.get("HOME")  # no forward runs it: nothing here is read

    def forward_fast(self, y):
        return y * self.scale * GAIN2

    def forward_slow(self, y):
        return y

    def forward(self, wav):
        return getattr(self, "forward_" + self.mode)(super().forward(wav))


class PicksAnyNameAndHasSetters(PicksAndHasSetters):
    head = "forward_fast"

    def forward(self, wav):
        return getattr(self, self.head)(super().forward(wav))


class Heads(torch.nn.Module):
    def fast(self, y):
        return y * shared.STATE.scale

    def forward(self, y):
        return y


class CallsASubmodulesMethod(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.heads = Heads()

    def forward(self, wav):
        return self.heads.fast(super().forward(wav))


class PickedHeads(torch.nn.Module):
    def fast_head(self, y):
        return y * shared.STATE.scale

    def slow_head(self, y):
        return y

    def forward(self, y):
        return y


class PicksOnASubmodule(TinyConvEncoder):
    mode = "fast"

    def __init__(self):
        super().__init__()
        self.heads = PickedHeads()

    def forward(self, wav):
        return getattr(self.heads, self.mode + "_head")(super().forward(wav))


def _picked_head(m, y):
    return getattr(m, "forward_" + m.mode)(y)


class PicksInAHelper(TinyConvEncoder):
    mode = "fast"

    def forward_fast(self, y):
        return y * shared.STATE.scale

    def forward(self, wav):
        return _picked_head(self, super().forward(wav))


class HoldsALibraryFunction(TinyConvEncoder):
    act = torch.sigmoid
    post = staticmethod(torch.nn.functional.gelu)

    def forward(self, wav):
        return self.post(self.act(super().forward(wav)))


class HasALibraryModule(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.post = torch.nn.Hardtanh(-10.0, 10.0)

    def forward(self, wav):
        return self.post(super().forward(wav))


class MyHardtanh(torch.nn.Hardtanh):
    tag = "mine"


class HasASubclassOfALibraryModule(HasALibraryModule):
    def __init__(self):
        super().__init__()
        self.post = MyHardtanh(-10.0, 10.0)


class HasAGelu(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.post = torch.nn.GELU()

    def forward(self, wav):
        return self.post(super().forward(wav))


class CallsGeluItself(TinyConvEncoder):
    def forward(self, wav):
        return torch.nn.functional.gelu(super().forward(wav))


def patched_gelu(x, approximate="none"):
    return x * shared.STATE.scale


def patched_gelu_otherwise(x, approximate="none"):
    return x * 0.5


def patched_hardtanh(self, x):
    return x * shared.STATE.scale


def patched_hardtanh_otherwise(self, x):
    return x * 0.5


class HasHeads(TinyConvEncoder):
    def forward_fast(self, y):
        return y * shared.STATE.scale


class PicksOnItsBaseClass(HasHeads):
    mode = "fast"

    def forward(self, wav):
        return getattr(super(), "forward_" + self.mode)(super().forward(wav))


SCALE_fast = 2.0


class SetsAGlobalByANameBesideAPick(TinyConvEncoder):
    head = "forward_fast"
    mode = "fast"

    @classmethod
    def set_scale(cls, mode, v):
        globals()["SCALE_" + mode] = v  # a setting, set by a name made at run time

    def forward_fast(self, y):
        return y * globals()["SCALE_" + self.mode]

    def forward(self, wav):
        return getattr(self, self.head)(super().forward(wav))


class SetsAGlobalByANameWhileTraining(TinyConvEncoder):
    mode = "fast"

    def forward(self, wav):
        y = super().forward(wav)
        if self.training:  # never in eval; the file binds SCALE_fast: a setting all the same
            globals()["SCALE_" + self.mode] = 1.0
        return y * globals()["SCALE_" + self.mode]


class Stats(torch.nn.Module):
    last = 0

    def record(self, y):
        type(self).last = int(y.shape[-1])  # its own state: the parent's forward runs it

    def forward(self, y):
        return y if self.last >= 0 else -y


class RecordsThroughASubmodule(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.stats = Stats()

    def forward(self, wav):
        y = super().forward(wav)
        self.stats.record(y)
        return self.stats(y)


class Pool(torch.nn.Module):
    def proj(self, y):  # no forward runs it: what it reads is no setting
        return y / (y.norm() + shared.STATE.scale)

    def forward(self, y):
        return y


class HasAProjAndAPool(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Identity()
        self.pool = Pool()

    def forward(self, wav):
        return self.pool(self.proj(super().forward(wav)))


class TimmLike(TinyConvEncoder):
    pool = "avg"
    gain = 1.0

    def forward_head(self, y):
        return y * 2.0 if self.pool == "avg" else y

    def forward(self, wav):
        return self.forward_head(super().forward(wav)) * self.gain


class Updates(torch.nn.Module):
    def update(self, y):
        return None

    def forward(self, y):
        return y


class UpdatesBesideAHeadsSetter(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.stats = Updates()
        self.head = UpdatableHead()

    def forward(self, wav):
        y = super().forward(wav)
        self.stats.update(y)  # Updates.update runs, not UpdatableHead.update (a setter)
        return self.head(y)


class Block(torch.nn.Module):
    def custom(self, y):
        return y * shared.STATE.scale

    def forward(self, y):
        return y


class RunsItsBlocksMethods(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, wav):
        y = super().forward(wav)
        for b in self.blocks:
            y = b.custom(y)
        return self.blocks[0].custom(y)


class SeesLengthsInAPickedHead(TinyConvEncoder):
    head = "fast"
    act = "SCALE"

    def fast(self, y):
        globals()["_seen_" + str(y.shape[-1])] = True  # its own state, by a name made now
        return y

    def forward(self, wav):
        return getattr(self, self.head)(super().forward(wav)) * globals()[self.act]


class ReadsAFunctionsName(TinyConvEncoder):
    def forward(self, wav):
        y = super().forward(wav)
        return gained(y) if gained.__name__ == "gained" else y


class PicksByTwoSettings(TinyConvEncoder):
    kind = "avg"
    size = "big"
    scale = 2.0

    @classmethod
    def set_scale(cls, s):
        cls.scale = s  # a setting: "_" alone, the pick's only known part, fits its name too

    def avg_big(self, y):
        return y * self.scale

    def forward(self, wav):
        return getattr(self, f"{self.kind}_{self.size}")(super().forward(wav))


class PicksBesideASetterKeepingTheOldValue(TinyConvEncoder):
    head = "forward_fast"
    scale = 2.0

    @classmethod
    def set_scale(cls, s):
        old, cls.scale = cls.scale, s  # read, then set plainly: a setting, not a counter
        return old

    def forward_fast(self, y):
        return y * self.scale

    def forward(self, wav):
        return getattr(self, self.head)(super().forward(wav))


class Node:
    def __init__(self):
        self.children = []  # no module's children: nothing to call

    def visit(self, y):
        return y


class VisitsATree(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.tree = Node()

    def forward(self, wav):
        return self.tree.visit(super().forward(wav))


class PassesASubmodulesMethodOn(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block()])
        self.block = Block()

    @property
    def first(self):
        return self.blocks[0]

    def forward(self, wav):
        run = self.block.custom  # taken, then called: as checkpoint(self.block.custom, y)
        return self.first.custom(run(super().forward(wav)))


class RescalableHead(torch.nn.Module):
    scale = 2.0

    @classmethod
    def update(cls, f):
        cls.scale = cls.scale * f  # a setter computing from the old value: no counter

    def forward(self, y):
        return y * self.scale


class UpdatesADictBesideARescalableHead(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.head = RescalableHead()

    def forward(self, wav):
        seen = {}
        seen.update(n=wav.shape[-1])
        return self.head(super().forward(wav))


class ReadsTheEnvironmentThroughALocalImport(TinyConvEncoder):
    def forward(self, wav):
        import os

        return super().forward(wav) * float(os.environ.get("FWDGLOBALS_GAIN", "1"))


class ReadsTheEnvironmentThroughImportToo(TinyConvEncoder):
    def forward(self, wav):
        import os

        gain = float(__import__("os").environ.get("FWDGLOBALS_GAIN2", "1"))
        return super().forward(wav) * float(os.environ.get("FWDGLOBALS_GAIN", "1")) * gain


class PicksThroughAConfig(TinyConvEncoder):
    cfg = {"mode": "fast"}
    scale = 2.0

    def forward_fast(self, y):
        return y * self.scale

    def forward(self, wav):
        return getattr(self, "forward_" + self.cfg["mode"], None)(super().forward(wav))


def configure(g):
    global GAIN_fast
    GAIN_fast = g


configure(2.0)


class ReadsAGlobalByAName(TinyConvEncoder):
    mode = "fast"

    def forward(self, wav):
        seen = "seen_" + str(wav.shape[-1])
        globals()[seen] = True  # its own state, by a name no part of which is known here
        return super().forward(wav) * globals()["GAIN_" + self.mode]


class UpdatableHead(torch.nn.Module):
    scale = 2.0

    @classmethod
    def update(cls, s):
        cls.scale = s  # a setting, though a dict's update shares its name

    def forward(self, y):
        return y * self.scale


class UpdatesADict(TinyConvEncoder):
    def __init__(self):
        super().__init__()
        self.head = UpdatableHead()

    def forward(self, wav):
        out = {}
        out.update(y=self.head(super().forward(wav)))
        return out["y"]


class PicksACountingHeadByAnyName(TinyConvEncoder):
    head = "forward_counted"
    calls = 0

    def forward_counted(self, y):
        type(self).calls += 1  # its own state, though only a pick of any name reaches it
        return y * shared.STATE.scale

    def forward(self, wav):
        return getattr(self, self.head)(super().forward(wav))


class Records(TinyConvEncoder):
    def forward(self, wav):
        global CALLS
        out = super().forward(wav)
        CALLS += 1
        shared.SEEN.append(1)
        shared.MONITOR.last = out.detach().mean()
        shared.STATS.calls += 1
        shared.STATS.total = shared.STATS.total + 1.0
        return out
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The user's package: ``shared`` (settings, a window, a helper) and ``model`` (encoder
    classes whose forward reads them), imported afresh."""
    files = {"shared.py": _SHARED, "model.py": _MODEL}
    with _user_package(tmp_path, monkeypatch, _PACKAGE, files):
        yield importlib.import_module(f"{_PACKAGE}.model")


def _setting(model: ModuleType) -> None:
    model.shared.STATE.scale = 3.0


def _gain(model: ModuleType) -> None:
    model.shared.GAIN["g"] = 3.0


def _cached_gain(model: ModuleType) -> None:
    model.shared.CACHED["g"] = 3.0
    model.shared.cached_gain.cache_clear()


#: Each case: the class of ``model`` and a change of a global its forward reads.
CHANGES: dict[str, tuple[str, Callable[[ModuleType], Any]]] = {
    "namespace-setting-edited": ("ReadsASetting", _setting),
    "namespace-replaced": (
        "ReadsASetting",
        lambda m: setattr(m.shared, "STATE", type(m.shared.STATE)(scale=0.5)),
    ),
    "helper-of-another-module-reads-a-dict": ("CallsAHelper", _gain),
    "global-tensor-edited": ("ReadsAWindow", lambda m: m.shared.WINDOW.fill_(0.25)),
    "global-of-its-own-file-bound-anew": ("ReadsItsFilesGlobal", lambda m: setattr(m, "SCALE", 4)),
    "read-by-a-method-it-calls": ("ScalesInAMethod", _gain),
    "read-by-a-submodule-of-the-users": ("HoldsAReader", _setting),
    # A second review of r24.1's first form: each of these was still served stale.
    "read-by-a-base-class-forward-through-super": ("ThroughSuper", _setting),
    "beside-a-table-too-large-to-key": ("LooksUpBesideASetting", lambda m: setattr(m, "SCALE", 4)),
    "read-by-a-base-method-an-override-runs-through-super": ("OverridesTheMethod", _gain),
    "read-by-a-helper-lru_cache-wraps": ("CallsACachedHelper", _cached_gain),
    "class-setting-set-on-the-class": (
        "ReadsAClassSetting",
        lambda m: setattr(m.ReadsAClassSetting, "SCALE", 3.0),
    ),
    "class-dict-read-through-type-edited": (
        "ReadsAClassSetting",
        lambda m: m.ReadsAClassSetting.OPTIONS.__setitem__("gain", 3.0),
    ),
    "global-array-edited-in-place": ("ReadsAnArray", lambda m: m.shared.ARRAY.__setitem__(0, 3.0)),
    # Round twenty-five: each of these was served stale.
    "library-function-bound-anew": ("BindsAnActivation", lambda m: setattr(m, "ACT", torch.tanh)),
    "class-setting-asked-by-getattr": (
        "AsksAClassSetting",
        lambda m: setattr(m.AsksAClassSetting, "SCALE", 3.0),
    ),
    "class-setting-asked-by-getattr-lost": (
        "AsksAClassSetting",
        lambda m: delattr(m.AsksAClassSetting, "SCALE"),
    ),
    "class-setting-gained-after-the-first-read": (
        "AsksASettingItMayGain",
        lambda m: setattr(m.AsksASettingItMayGain, "GAIN", 3.0),
    ),
    "read-by-a-users-override-a-library-forward-calls": ("HoldsAnOverridingConv", _setting),
    "read-by-a-method-a-helper-given-self-calls": ("ScalesThroughAHelperGivenSelf", _setting),
    "library-function-of-another-module-bound-anew": (
        "CallsALibraryFunctionOfAnotherModule",
        lambda m: setattr(m.shared, "gelu", torch.tanh),
    ),
    "read-by-a-method-a-helper-of-another-module-given-self-calls": (
        "ScalesThroughAHelperOfAnotherModule",
        _setting,
    ),
    "class-setting-a-helper-given-self-reads": (
        "AHelperReadsAClassSetting",
        lambda m: setattr(m.AHelperReadsAClassSetting, "SCALE", 3.0),
    ),
    "read-by-a-method-asked-by-getattr": ("AsksForAMethod", _setting),
    "class-setting-gained-as-another-is-lost": (
        "AsksAsTheClassSwapsNames",
        lambda m: (
            delattr(m.AsksAsTheClassSwapsNames, "OLD"),
            setattr(m.AsksAsTheClassSwapsNames, "K", 3.0),
        ),
    ),
    "read-by-an-override-a-users-forward-runs-through-super": (
        "HoldsAConvWithAForwardOfItsOwn",
        _setting,
    ),
    "class-setting-beside-another-objects-field-of-its-name": (
        "LogsItsScale",
        lambda m: setattr(m.LogsItsScale, "scale", 3.0),
    ),
    "class-setting-beside-another-classes-field-of-its-name": (
        "LogsOnANamespaceClass",
        lambda m: setattr(m.LogsOnANamespaceClass, "scale", 3.0),
    ),
    "method-replaced-at-run-time": (
        "PostProcesses",
        lambda m: (setattr(m.PostProcesses, "post", m.scaled_post), _setting(m)),
    ),
    "class-tensor-edited-in-place": (
        "HoldsAClassWindow",
        lambda m: m.HoldsAClassWindow.WINDOW.fill_(0.25),
    ),
    # Round twenty-six: each of these was served stale.
    "read-by-a-method-picked-by-a-name-made-at-run-time": ("PicksAHeadByName", _setting),
    "class-setting-read-by-a-method-picked-by-an-f-string": (
        "PicksAHeadByAnFString",
        lambda m: setattr(m.PicksAHeadByAnFString, "GAIN", 3.0),
    ),
    "read-by-the-function-of-a-partialmethod": ("HasAPartialMethod", _setting),
    "partialmethod-keyword-set-anew": (
        "HasAPartialMethod",
        lambda m: setattr(
            m.HasAPartialMethod,
            "forward_fast",
            functools.partialmethod(m.HasAPartialMethod._run, scale=3.0),
        ),
    ),
    "read-by-a-forward-a-decorator-wraps-without-wraps": ("WrappedWithoutWraps", _setting),
    "read-by-an-overridden-call": ("ScalesInItsCall", _setting),
    "class-setting-read-by-an-overridden-call": (
        "ScalesInItsCall",
        lambda m: setattr(m.ScalesInItsCall, "GAIN", 3.0),
    ),
    "global-read-through-globals": ("ReadsThroughGlobals", lambda m: setattr(m, "SCALE", 4)),
    "global-dict-item-read-through-globals": (
        "ReadsThroughGlobals",
        lambda m: m.OPTIONS.__setitem__("gain", 3.0),
    ),
    "global-gained-read-through-globals-get": (
        "ReadsThroughGlobals",
        lambda m: setattr(m, "EXTRA", 3.0),
    ),
    "helper-picked-from-globals-by-a-name-made-at-run-time": ("PicksAHelperByName", _gain),
    "read-by-a-submodules-method-its-parent-calls": ("CallsASubmodulesMethod", _setting),
    "class-setting-read-by-a-method-picked-through-a-config": (
        "PicksThroughAConfig",
        lambda m: setattr(m.PicksThroughAConfig, "scale", 3.0),
    ),
    "global-read-through-globals-by-a-name-a-function-binds": (
        "ReadsAGlobalByAName",
        lambda m: m.configure(3.0),
    ),
    "class-setting-set-by-a-classmethod-named-as-a-dicts-method": (
        "UpdatesADict",
        lambda m: m.UpdatableHead.update(3.0),
    ),
    "read-by-a-counting-head-picked-by-any-name": ("PicksACountingHeadByAnyName", _setting),
    "read-by-a-base-class-method-picked-through-super": ("PicksOnItsBaseClass", _setting),
    "class-setting-set-by-a-classmethod-named-as-another-submodules-method": (
        "UpdatesBesideAHeadsSetter",
        lambda m: m.UpdatableHead.update(3.0),
    ),
    "read-by-methods-called-on-a-module-lists-blocks": ("RunsItsBlocksMethods", _setting),
    "read-by-a-submodules-method-passed-on-or-reached-through-a-property": (
        "PassesASubmodulesMethodOn",
        _setting,
    ),
    "class-setting-rescaled-by-a-classmethod-named-as-a-dicts-method": (
        "UpdatesADictBesideARescalableHead",
        lambda m: m.RescalableHead.update(3.0),
    ),
    "class-setting-set-by-a-classmethod-a-separator-alone-fits": (
        "PicksByTwoSettings",
        lambda m: m.PicksByTwoSettings.set_scale(3.0),
    ),
    "class-setting-set-by-a-classmethod-keeping-the-old-value": (
        "PicksBesideASetterKeepingTheOldValue",
        lambda m: m.PicksBesideASetterKeepingTheOldValue.set_scale(3.0),
    ),
    "global-set-by-a-name-by-a-classmethod-beside-a-pick-of-any-name": (
        "SetsAGlobalByANameBesideAPick",
        lambda m: m.SetsAGlobalByANameBesideAPick.set_scale("fast", 3.0),
    ),
    "global-the-file-binds-though-the-forward-sets-it-by-a-name": (
        "SetsAGlobalByANameWhileTraining",
        lambda m: setattr(m, "SCALE_fast", 5.0),
    ),
    "library-function-a-class-holds-swapped": (
        "HoldsALibraryFunction",
        lambda m: setattr(m.HoldsALibraryFunction, "act", torch.tanh),
    ),
    "library-static-method-a-class-holds-swapped": (
        "HoldsALibraryFunction",
        lambda m: setattr(m.HoldsALibraryFunction, "post", staticmethod(torch.relu)),
    ),
    "read-by-a-submodules-method-picked-by-a-name-made-at-run-time": (
        "PicksOnASubmodule",
        _setting,
    ),
    "read-by-a-method-a-helper-picks-by-a-name-made-at-run-time": ("PicksInAHelper", _setting),
    # What a method the forward never runs sets is a setting, not the forward's own state.
    "class-setting-set-by-a-classmethod-beside-a-picked-head": (
        "PicksAndHasSetters",
        lambda m: m.PicksAndHasSetters.set_scale(3.0),
    ),
    "global-set-by-a-method-beside-a-picked-head": (
        "PicksAndHasSetters",
        lambda m: m.PicksAndHasSetters().set_gain(3.0),
    ),
    "class-setting-set-by-a-classmethod-beside-a-head-picked-by-any-name": (
        "PicksAnyNameAndHasSetters",
        lambda m: m.PicksAnyNameAndHasSetters.set_scale(3.0),
    ),
    "global-set-by-a-method-beside-a-head-picked-by-any-name": (
        "PicksAnyNameAndHasSetters",
        lambda m: m.PicksAnyNameAndHasSetters().set_gain(3.0),
    ),
}


@pytest.mark.parametrize("how", list(CHANGES))
def test_a_global_the_forward_reads_changed_between_datasets_is_not_served_stale(
    package: ModuleType, tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """A first dataset bakes an item; the global changes; a second dataset on the same store
    serves what the module returns now (it served the first run's features)."""
    name, change = CHANGES[how]
    module = getattr(package, name)().eval()
    _served_live_after(audio_dir, module, tmp_path, lambda: change(package))


@pytest.mark.parametrize("how", list(CHANGES))
def test_a_global_the_forward_reads_changed_under_an_open_cached_encoder_is_not_served_stale(
    package: ModuleType, tmp_path: Path, how: str
) -> None:
    """Changed after three calls of one ``CachedEncoder`` (its RAM tier warm, its watch past
    its first exact reads): the watch reads the forward's globals at each call."""
    name, change = CHANGES[how]
    module = frozen(getattr(package, name)())
    served_live_by_an_open_cached_encoder(module, tmp_path, lambda: change(package))


def test_a_global_changed_after_the_dataset_was_made_refuses_its_misses_in_one_line(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """The dataset's keys were made with the setting as it was: a miss encoded now would be
    stored under them. It is refused, naming the global and what to do."""
    module = package.ReadsASetting().eval()
    ds = _first_dataset(audio_dir, module, tmp_path)
    ds[0]
    _setting(package)
    said = _refused_in_one_line(ds, 1, "changed since this dataset was created")
    assert "the global shared.STATE that the module's forward reads changed since" in said


def test_a_forward_recording_into_globals_keeps_its_key(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """A forward that bumps a counter of its file, appends to a global list, sets a value on
    a global object it never reads back and bumps fields of another (``STATS.calls += 1``,
    ``STATS.total = STATS.total + 1``) changes nothing it returns: a dataset made after it
    ran serves every item from the store (``on_miss="error"``), and a second pass of one
    ``CachedEncoder`` is all hits. r24.1's first form read the bumped fields: a dataset
    refused its second miss as a changed module."""
    module = frozen(package.Records())
    before = from_module(module).fingerprint
    x = waves(2)
    cached = CachedEncoder(module, cache=tmp_path / "c", ram_cache=0)
    cached(x, ids=["a", "b"])
    cached(x, ids=["a", "b"])
    # one batch ran, and its last row alone once more (CachedEncoder's check of its rows)
    assert package.CALLS == 2 and package.shared.MONITOR.last is not None
    assert from_module(module).fingerprint == before
    assert cached.cache_info()["encoded"] == 2
    again = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(again, module, 2)


def test_a_forward_keeping_state_of_its_own_in_globals_keeps_its_key(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """A warn-once flag, a window made at the first call, a memo dict of windows by length
    (HiFi-GAN's), a step counter and an accumulator updated in place are the forward's own
    state, read back or not: r24.1's second form keyed them, so the key changed at the first
    forward and a dataset refused its second miss as a changed module."""
    module = package.KeepsStateOfItsOwn().eval()
    before = from_module(module).fingerprint
    with torch.inference_mode():
        module(waves(1))
    assert package.STEP == 1 and from_module(module).fingerprint == before
    again = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(again, module, 2)


@pytest.mark.parametrize("name", ["ReadsASetting", "CallsAHelper", "ReadsAWindow"])
def test_an_unchanged_global_serves_hits(
    package: ModuleType, tmp_path: Path, audio_dir: Path, name: str
) -> None:
    """No needless miss: the forward's globals read alike at each call and in a dataset
    reopened with ``on_miss="error"``."""
    module = frozen(getattr(package, name)())
    x = waves(3)
    ids = [f"utt{i}" for i in range(3)]
    cached = CachedEncoder(module, cache=tmp_path / "c", ram_cache=0)
    cached(x, ids=ids)
    cached(x, ids=ids)
    assert cached.cache_info()["encoded"] == 3
    reopened = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)
    _assert_live(reopened, module, 2)


#: Round twenty-six's forwards, each read further than a forward's own code now.
RUN_TIME_PICKS = [
    "PicksAHeadByName",
    "PicksAHeadByAnFString",
    "HasAPartialMethod",
    "WrappedWithoutWraps",
    "ScalesInItsCall",
    "ReadsThroughGlobals",
    "PicksAHelperByName",
    "WarnsOncePerLength",
    "PicksAndHasSetters",
    "CallsASubmodulesMethod",
    "PicksOnASubmodule",
    "PicksInAHelper",
    "HoldsALibraryFunction",
    "PicksThroughAConfig",
    "ReadsAGlobalByAName",
    "UpdatesADict",
    "PicksACountingHeadByAnyName",
    "PicksOnItsBaseClass",
    "RecordsThroughASubmodule",
    "TimmLike",
    "UpdatesBesideAHeadsSetter",
    "RunsItsBlocksMethods",
    "SeesLengthsInAPickedHead",
    "ReadsAFunctionsName",
    "PicksByTwoSettings",
    "VisitsATree",
    "PassesASubmodulesMethodOn",
]


@pytest.mark.parametrize("name", RUN_TIME_PICKS)
def test_a_forward_read_further_unchanged_keeps_its_key(
    package: ModuleType, tmp_path: Path, audio_dir: Path, name: str
) -> None:
    """No needless miss where a forward picks a method by a name made at run time, runs a
    ``partialmethod``, is wrapped without ``functools.wraps``, runs through an overridden
    ``__call__`` or reads ``globals()["K"]``, its settings unchanged: the key is the same after
    forwards ran (a counter it keeps on its class, a global it sets through ``globals()``, a
    wrapper's call count are its own state), a second pass of one ``CachedEncoder`` is all
    hits and a dataset reopened with ``on_miss="error"`` serves every item from the store."""
    module = frozen(getattr(package, name)())
    before = from_module(module).fingerprint
    assert_a_second_pass_hits(module, tmp_path / "c")
    assert from_module(module).fingerprint == before
    reopened = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(reopened, module, 2)
    assert from_module(module).fingerprint == before


def test_what_a_method_no_picked_name_fits_reads_is_not_keyed(
    package: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward picking ``"forward_" + self.mode`` runs the methods whose names fit it: what
    another method of the class reads (``describe`` reading ``sys.argv`` and the
    environment) is no setting of the forward's; keyed, each command line would be another
    key and its store encoded again."""
    module = frozen(package.PicksAndHasSetters())
    before = from_module(module).fingerprint
    monkeypatch.setattr(sys, "argv", [*sys.argv, "--another-run"])
    monkeypatch.setenv("HOME", "/elsewhere")
    assert from_module(module).fingerprint == before


def test_a_submodules_method_no_forward_calls_is_not_read(package: ModuleType) -> None:
    """``self.proj(y)`` runs the module held as ``proj``, not a method ``proj`` a submodule's
    class holds: what that method reads is no setting (only ``self.<sub>.<name>(...)`` runs a
    submodule's method by name); and the forward's rows come in the order its code reaches
    them, its own forward first, as before (a store built before keeps its keys)."""
    module = frozen(package.HasAProjAndAPool())
    before = from_module(module).fingerprint
    package.shared.STATE.scale = 3.0
    assert from_module(module).fingerprint == before
    rows = forward_globals(frozen(package.TimmLike()), exact=True)
    assert rows.index("TimmLike.forward@") < rows.index("TimmLike.forward_head@")
    rows = forward_globals(frozen(package.ReadsAFunctionsName()), exact=True)
    assert rows.count("global gained=") == 1  # gained.__name__: the global, read once


def test_a_local_import_reads_the_variables_named_alone(
    package: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward importing ``os`` in its body and reading ``os.environ.get("GAIN")`` is keyed
    by that variable, as one importing it at the file's top is: every variable keyed, a
    ``RANK`` or ``CUDA_VISIBLE_DEVICES`` set by the launcher made each run another key."""
    monkeypatch.delenv("FWDGLOBALS_GAIN", raising=False)
    module = frozen(package.ReadsTheEnvironmentThroughALocalImport())
    before = from_module(module).fingerprint
    monkeypatch.setenv("FWDGLOBALS_RANK", "3")
    assert from_module(module).fingerprint == before
    monkeypatch.setenv("FWDGLOBALS_GAIN", "2")
    assert from_module(module).fingerprint != before
    beside = frozen(package.ReadsTheEnvironmentThroughImportToo())
    before = from_module(beside).fingerprint
    monkeypatch.setenv("FWDGLOBALS_GAIN2", "2")  # read through __import__("os"): read whole
    assert from_module(beside).fingerprint != before


@pytest.mark.parametrize(
    "module",
    [TinyConvEncoder(), torch.nn.TransformerEncoderLayer(16, 2, 32)],
    ids=["featbake-tiny", "torch-layer"],
)
def test_a_module_reading_no_setting_keeps_the_identity_it_had(module: torch.nn.Module) -> None:
    """Library code reads library globals (versioned by the library, or torch's left out):
    no global is read, and the identity has no part of them, as before."""
    assert forward_globals(module, exact=True) == ""
    assert "\nglobals:" not in module_identity(module)


def test_a_library_function_bound_as_the_file_binds_it_keeps_the_identity_it_had(
    package: ModuleType,
) -> None:
    """``ACT = torch.sigmoid`` at a file's top level, an alias whose function has another
    name (``from torch.fft import rfft``, ``from numpy import abs as npabs``, ``getattr(torch,
    "tanh")``) is the code's own choice, keyed by the file's source: no global row, as before
    round twenty-five; only one bound otherwise since is read. One the file binds in two
    branches (by the environment) is a setting, keyed by the function chosen."""
    module = package.BindsAnActivation().eval()
    assert forward_globals(module, exact=True) == ""
    assert forward_globals(package.CallsAliases().eval(), exact=True) == ""
    package.ACT = torch.tanh
    assert "global ACT=<torch." in forward_globals(module, exact=True)
    chosen = forward_globals(package.CallsAChosenActivation().eval(), exact=True)
    assert "global CHOSEN=<torch._VariableFunctionsClass.sigmoid>" in chosen
    whisper = package.AttendsAsWhisperDoes().eval()  # try/except import, a held F.silu
    assert forward_globals(whisper, exact=True) == ""
    assert "silu" not in module_identity(whisper)


def test_a_library_function_a_class_body_binds_keeps_the_identity_it_had(
    package: ModuleType,
) -> None:
    """``act = torch.sigmoid`` in a class body is the code's own choice, keyed by its
    source: no row, as before (a store built before is served); one set on the class since
    (``Block.act = torch.tanh``) is read by the function it names. ``staticmethod(F.gelu)``
    in the body is read as its function."""
    assert forward_globals(package.HoldsALibraryFunction().eval(), exact=True) == ""
    package.HoldsALibraryFunction.act = torch.tanh
    assert "act=<torch." in forward_globals(package.HoldsALibraryFunction().eval(), exact=True)


#: Each case: what a script patches with the user's function (an object and a name), the
#: function it sets and the one set in its place later, and the module whose forward runs it.
PATCHES: dict[str, tuple[Any, str, str, str, str]] = {
    # As a faster attention is patched into a library's class: the user's subclass too.
    "library-class-method": (
        torch.nn.Hardtanh, "forward", "patched_hardtanh", "patched_hardtanh_otherwise",
        "HasALibraryModule",
    ),
    "library-class-method-under-the-users-subclass": (
        torch.nn.Hardtanh, "forward", "patched_hardtanh", "patched_hardtanh_otherwise",
        "HasASubclassOfALibraryModule",
    ),
    # F.gelu = my_gelu, called by nn.GELU's forward or by the user's own.
    "library-function-a-library-forward-calls": (
        torch.nn.functional, "gelu", "patched_gelu", "patched_gelu_otherwise", "HasAGelu",
    ),
    "library-function-the-users-forward-calls": (
        torch.nn.functional, "gelu", "patched_gelu", "patched_gelu_otherwise", "CallsGeluItself",
    ),
}  # fmt: skip


@pytest.mark.parametrize("patch", list(PATCHES))
@pytest.mark.parametrize("change", ["patched-otherwise", "setting-the-patch-reads", "unpatched"])
def test_a_library_patched_with_the_users_function_is_not_served_stale(
    package: ModuleType,
    tmp_path: Path,
    audio_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: str,
    patch: str,
) -> None:
    """What the library runs is the user's function, keyed by its code and what it reads: a
    dataset after the patch is replaced, a setting it reads changed, or the patch undone
    serves what the module returns now (each served the first run's features). Unpatched,
    the library keeps the key it had."""
    owner, name, first, otherwise, holder = PATCHES[patch]
    module = getattr(package, holder)().eval()
    unpatched = from_module(module).fingerprint
    monkeypatch.setattr(owner, name, getattr(package, first))
    assert from_module(module).fingerprint != unpatched

    def changed() -> None:
        if change == "patched-otherwise":
            setattr(owner, name, getattr(package, otherwise))
        elif change == "setting-the-patch-reads":
            package.shared.STATE.scale = 3.0
        else:
            monkeypatch.undo()

    _served_live_after(audio_dir, module, tmp_path, changed)
    monkeypatch.undo()
    assert from_module(module).fingerprint == unpatched


def test_a_class_whose_bases_are_set_anew_is_keyed_again(package: ModuleType) -> None:
    """``Cls.__bases__`` set after a first key: the next key reads the class as it is now.
    The first form of r25.1 raised ValueError there (the classes of its MRO kept by count)."""
    module = package.ReadsAClassSetting().eval()
    before = module_identity(module)

    class Mixin:
        pass

    package.ReadsAClassSetting.__bases__ = (Mixin, package.TinyConvEncoder)
    assert "SCALE=2.0" in forward_globals(module, exact=True)
    assert module_identity(module) == before  # an empty mixin changes nothing read
    package.ReadsAClassSetting.SCALE = 3.0
    assert "SCALE=3.0" in forward_globals(module, exact=True)
    assert module_identity(module) != before


def test_a_counter_the_forward_keeps_on_its_class_keeps_its_key(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """``type(self).calls += 1`` and a shape set through a local holding the class are the
    forward's own state: r25.1's third form keyed them (the augmented store's object is not
    the instruction before it), so every dataset made after a forward missed every item."""
    module = package.CountsOnItsClass().eval()
    before = from_module(module).fingerprint
    with torch.inference_mode():
        module(waves(1))
        module(waves(1))
    assert package.CountsOnItsClass.calls == 2
    assert from_module(module).fingerprint == before
    again = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(again, module, 2)


def test_a_class_cache_the_forward_fills_keeps_its_key(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """A window the forward sets on its class at its first call (``type(self)._fb = w``)
    and a memo dict on the class it fills are its own state: the first form of r25.1 keyed
    the window once set (the class gained a name), so a dataset made after a forward ran
    missed every item stored before it."""
    module = package.CachesAWindowOnItsClass().eval()
    before = from_module(module).fingerprint
    with torch.inference_mode():
        module(waves(1))
    assert hasattr(package.CachesAWindowOnItsClass, "_fb")
    assert from_module(module).fingerprint == before
    again = _baked_then_reopened(audio_dir, module, tmp_path / "d", n=2)  # on_miss="error"
    _assert_live(again, module, 2)


_SPAWNED = """
import sys, warnings
sys.path.insert(0, {code!r})
from torch.utils.data import DataLoader
from featbake.serve.dataset import CachedFeatureDataset
from {package}.model import LooksUpBesideASetting


def main():
    ds = CachedFeatureDataset({audio!r}, LooksUpBesideASetting().eval(), cache={cache!r})
    ctx = "spawn"
    for _ in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=ctx):
        pass


if __name__ == "__main__":
    warnings.simplefilter("default")
    main()
"""


def test_what_a_key_leaves_out_is_said_once_not_again_in_each_worker(
    package: ModuleType, tmp_path: Path, audio_dir: Path
) -> None:
    """A dataset whose module's forward reads a table too large to key says so once, naming
    the table, in its own process; its spawned ``DataLoader`` workers, which read the key
    again as they unpickle the dataset, say nothing (the first form said it in each)."""
    script = tmp_path / "spawned.py"
    code = str(Path(package.__file__).parent.parent)
    cache = str(tmp_path / "s")
    source = _SPAWNED.format(code=code, package=_PACKAGE, audio=str(audio_dir), cache=cache)
    script.write_text(source)
    ran = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    said = [line for line in ran.stderr.splitlines() if "KeyLeftOutWarning" in line]
    assert len(said) == 1, ran.stderr[-3000:]
    assert "reads EMBEDDINGS (a value too large" in said[0]
    assert said[0].startswith(f"{script}:")  # the user's line, not featbake's


def test_a_global_adapter_in_train_mode_is_said_once_naming_what_to_do(
    package: ModuleType, recwarn: pytest.WarningsRecorder
) -> None:
    """A global adapter in train mode is left out of the key (its draws differ at each
    forward): a change to it changes no key, so the key's reading says so once per process,
    naming the adapter and ``.eval()``; in eval mode it is keyed by its weights, unsaid."""
    from featbake.encode.identity import KeyLeftOutWarning

    module = package.ReadsAGlobalAdapter().eval()
    package.ADAPTER.eval()
    before = module_identity(module)
    assert not [w for w in recwarn if w.category is KeyLeftOutWarning]
    with torch.no_grad():
        package.ADAPTER[0].weight.add_(1.0)
    assert module_identity(module) != before  # keyed by its weights
    package.ADAPTER.train()
    module_identity(module)
    module_identity(module)
    said = [str(w.message) for w in recwarn if w.category is KeyLeftOutWarning]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "ReadsAGlobalAdapter reads ADAPTER (the module Sequential in train mode" in said[0]
    assert said[0].endswith("call .eval() on it")
