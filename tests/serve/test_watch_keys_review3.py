"""Round thirteen's keying: what an encoder's forward writes from state it had before is no
derived state (``keys.fresh_writes``), and a module of the user's kept in a local or held as a
value is read through (``identity.attribute_chains``, ``HeldReading``): each test compares what
a dataset serves after a change with the encoder run now (docs/reliability.md, "Round
thirteen: keying")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.keys import derived_attributes, fresh_attribute_writes, tensor_attributes
from featbake.testing import TinyConvEncoder
from tests.serve.test_watch_keys import (
    _assert_live,
    _baked_then_reopened,
    _served_live_after_a_new_scale,
)
from tests.serve.test_watch_keys_review import _served_after_change

THIS_MODULE = sys.modules[__name__]  # as ``import config`` of a user's own module


# -- a setting the forward writes back from what it was -------------------------------------------


class _Scaled(TinyConvEncoder):
    """An encoder whose output is scaled by a tensor the user sets (``module.scale = ...``),
    which its forward writes back in one of the shapes below."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.tensor(2.0)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.rewrite(wav)
        return super().forward(wav) * self.scale

    def rewrite(self, wav: torch.Tensor) -> None:
        raise NotImplementedError

    def current(self) -> torch.Tensor:
        return self.scale


class _ThroughLocal(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        s = self.scale
        self.scale = s.to(wav.device)


class _ThroughConditional(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.scale.to(wav.dtype) if wav.numel() else torch.ones(())


class _ThroughWalrus(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        if (s := self.scale).device != wav.device:
            s = s.to(wav.device)
        self.scale = s


class _ThroughWalrusStore(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = (s := self.scale.to(wav.device))
        del s


class _ThroughTwoLocals(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        a = self.scale
        b = a * 1
        self.scale = b


class _ThroughUnpacking(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        s, _ = self.scale, wav.device
        self.scale = s


class _ThroughOtherAttribute(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.held = self.scale
        self.scale = self.held.to(wav.device)


class _ThroughMethod(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.current().to(wav.device)


class _ThroughGetattr(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = getattr(self, "scale").to(wav.device)  # noqa: B009 - the shape tested


class _ThroughCopy(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        out = torch.empty(())
        out.copy_(self.scale)
        self.scale = out


class _ThroughArgument(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.put(self.scale.to(wav.device))

    def put(self, value: torch.Tensor) -> None:
        self.scale = value


class _ThroughTry(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        try:
            s = torch.ones(()) if wav.numel() < 0 else self.scale
        except RuntimeError:
            s = torch.ones(())
        self.scale = s


class _ThroughClosure(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        def moved() -> torch.Tensor:
            return self.scale.to(wav.device)

        self.scale = moved()


class _ThroughLambda(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = (lambda v: v.to(wav.device))(self.scale)


class _ThroughLoop(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        s = torch.ones(())
        for s in [self.scale]:  # noqa: B007 - the loop's variable is what is kept
            pass
        self.scale = s


class _ThroughWith(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        with torch.no_grad():
            s = self.scale
        self.scale = s.to(wav.device)


class _ThroughContainer(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        kept = {"s": self.scale}
        self.scale = kept["s"]


class _ThroughVars(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = vars(self)["scale"].to(wav.device)


class _ThroughProperty(_Scaled):
    @property
    def moved(self) -> torch.Tensor:
        return self.scale

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = self.moved.to(wav.device)


class _ThroughGenerator(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = torch.stack(list(s for s in [self.scale])).sum()


class _Holder(_Scaled):
    def current(self) -> torch.Tensor:
        return self.scale


class _ThroughSuper(_Holder):
    def current(self) -> torch.Tensor:
        return torch.ones(())

    def rewrite(self, wav: torch.Tensor) -> None:
        self.scale = super().current().to(wav.device)


#: A module-level stash a forward routes a setting through.
STASH: dict[str, Any] = {}
_STASHED: Any = None


class _ThroughGlobalDict(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        STASH["scale"] = self.scale
        self.scale = STASH["scale"].to(wav.device)


class _ThroughGlobal(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        global _STASHED
        _STASHED = self.scale
        self.scale = _STASHED.to(wav.device)


class _ThroughException(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        try:
            raise LookupError(self.scale)
        except LookupError as e:
            self.scale = e.args[0]


class _ThroughSubmodule(_Scaled):
    def rewrite(self, wav: torch.Tensor) -> None:
        self.conv1.stash = self.scale
        self.scale = self.conv1.stash.to(wav.device)


REWRITES = {
    "local": _ThroughLocal,
    "conditional": _ThroughConditional,
    "walrus": _ThroughWalrus,
    "walrus-stored": _ThroughWalrusStore,
    "two-locals": _ThroughTwoLocals,
    "unpacking": _ThroughUnpacking,
    "other-attribute": _ThroughOtherAttribute,
    "method": _ThroughMethod,
    "getattr": _ThroughGetattr,
    "copy": _ThroughCopy,
    "argument": _ThroughArgument,
    "try": _ThroughTry,
    "closure": _ThroughClosure,
    "lambda": _ThroughLambda,
    "loop": _ThroughLoop,
    "with": _ThroughWith,
    "container": _ThroughContainer,
    "vars": _ThroughVars,
    "property": _ThroughProperty,
    "generator": _ThroughGenerator,
    "super": _ThroughSuper,
    "global-dict": _ThroughGlobalDict,
    "global": _ThroughGlobal,
    "exception": _ThroughException,
    "submodule": _ThroughSubmodule,
}


@pytest.mark.parametrize("shape", list(REWRITES))
def test_a_setting_the_forward_writes_back_from_itself_stays_keyed(
    tmp_path: Path, audio_dir: Path, shape: str
) -> None:
    cls = REWRITES[shape]
    assert "scale" not in derived_attributes(cls)
    module = cls().eval()

    _served_live_after_a_new_scale(audio_dir, module, tmp_path)


class _LazyTable(TinyConvEncoder):
    """A positional table made in ``forward`` through locals from the input's length only
    (ESPnet's ``extend_pe``): derived state, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.pe: torch.Tensor | None = None
        self.d_model = 64

    def extend_pe(self, x: torch.Tensor) -> None:
        if self.pe is not None and self.pe.size(0) >= x.size(1):
            if self.pe.dtype != x.dtype:
                self.pe = self.pe.to(dtype=x.dtype)
            return
        pe = torch.zeros(x.size(1), self.d_model)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        pe[:, 0::2] = torch.sin(position / 100.0)
        pe[:, 1::2] = torch.cos(position / 100.0)
        n = x.size(1) if x.size(1) > 0 else 1
        self.pe = pe[:n].to(device=x.device, dtype=x.dtype)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = super().forward(wav)
        self.extend_pe(x)
        x = x + self.pe[: x.size(1)]
        return x


def test_a_table_made_anew_through_locals_stays_derived(tmp_path: Path, audio_dir: Path) -> None:
    assert "pe" in derived_attributes(_LazyTable)
    module = _LazyTable().eval()
    second = _baked_then_reopened(audio_dir, module, tmp_path, n=2)
    _assert_live(second, module, 2)


def test_fresh_writes_read_through_locals_branches_and_walruses() -> None:
    def forward(self: Any, x: Any) -> None:
        y = self.a
        self.a = y * 2
        self.b = self.b if x else 0
        self.c = (z := self.c)
        self.d = torch.zeros(len(x)) if x else torch.ones(len(x))
        w = torch.zeros(3)
        self.e = w.to(x.device)
        del z

    assert fresh_attribute_writes(forward.__code__) == {"d", "e"}


def test_the_moved_settings_keep_their_tensor_attributes_keyed() -> None:
    names = [name for name, _ in tensor_attributes(_ThroughLocal())]
    assert names == ["scale"]


# -- a module of the user's kept in a local or held as a value -----------------------------------

LOCAL_GAIN = 2.0
SETTINGS = {"gain": 2.0}


def _module_in_local(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    cfg = THIS_MODULE
    return (args[0] * cfg.LOCAL_GAIN,)


def _module_in_walrus(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * (cfg := THIS_MODULE).LOCAL_GAIN * (cfg is not None),)


def _module_in_local_by_getattr(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    cfg = THIS_MODULE
    return (args[0] * getattr(cfg, "LOCAL_GAIN", 1.0),)


def _module_as_keyword_default(
    module: torch.nn.Module, args: tuple[Any, ...], *, cfg: Any = THIS_MODULE
) -> tuple[Any, ...]:
    return (args[0] * cfg.LOCAL_GAIN,)


class _HoldsModules:
    """A hook object holding config modules in a list."""

    def __init__(self) -> None:
        self.cfgs = [THIS_MODULE]

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.cfgs[0].LOCAL_GAIN,)


def _dict_of_module_in_local(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    cfg = THIS_MODULE
    return (args[0] * cfg.SETTINGS["gain"],)


def _module_passed_on(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * _gain_of(THIS_MODULE),)


def _gain_of(cfg: Any) -> float:
    return float(cfg.LOCAL_GAIN)


def _module_in_closure_cell() -> Any:
    cfg = THIS_MODULE

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * cfg.LOCAL_GAIN,)

    return hook


def _module_as_default(
    module: torch.nn.Module, args: tuple[Any, ...], cfg: Any = THIS_MODULE
) -> tuple[Any, ...]:
    return (args[0] * cfg.LOCAL_GAIN,)


class _HoldsModule:
    """A hook object holding the user's config module (``self.cfg_module = config``)."""

    def __init__(self) -> None:
        self.cfg_module = THIS_MODULE

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        c = self.cfg_module
        return (args[0] * c.LOCAL_GAIN,)


class _ReadsHeldModule(_HoldsModule):
    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.cfg_module.LOCAL_GAIN,)


LOCAL_HOOKS: dict[str, Any] = {
    "local": _module_in_local,
    "walrus": _module_in_walrus,
    "passed-on": _module_passed_on,
    "closure-cell": _module_in_closure_cell(),
    "default": _module_as_default,
    "object-local": _HoldsModule(),
    "object-attribute": _ReadsHeldModule(),
    "getattr-local": _module_in_local_by_getattr,
    "keyword-default": _module_as_keyword_default,
    "object-list": _HoldsModules(),
}


@pytest.mark.parametrize("held", list(LOCAL_HOOKS))
def test_a_setting_read_through_a_module_kept_in_a_local_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, held: str
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        LOCAL_HOOKS[held],
        lambda: monkeypatch.setattr(THIS_MODULE, "LOCAL_GAIN", 3.0),
    )


def test_a_dict_read_through_a_module_kept_in_a_local_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path,
        audio_dir,
        _dict_of_module_in_local,
        lambda: monkeypatch.setitem(SETTINGS, "gain", 3.0),
    )


#: A package of the user's, written at each test: settings, and hooks importing them inside.
_HOOKS_SOURCE = """
def absolute(module, args):
    import review3_pkg.config as cfg
    return (args[0] * cfg.GAIN,)


def setting(module, args):
    from review3_pkg.config import GAIN
    return (args[0] * GAIN,)


def dotted(module, args):
    import review3_pkg.config
    return (args[0] * review3_pkg.config.GAIN,)


def relative(module, args):
    from . import config as cfg
    return (args[0] * cfg.GAIN,)


def passed_on(module, args):
    from . import config
    return (args[0] * gain_of(config),)


def gain_of(cfg):
    return cfg.GAIN
"""


@pytest.mark.parametrize("imported", [True, False], ids=["imported", "not-imported-yet"])
@pytest.mark.parametrize("how", ["absolute", "setting", "dotted", "relative", "passed_on"])
def test_a_setting_of_a_module_imported_in_the_hook_is_keyed(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str, imported: bool
) -> None:
    import importlib

    package = tmp_path / "code" / "review3_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text("GAIN = 2.0\n")
    (package / "hooks.py").write_text(_HOOKS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    try:
        hooks = importlib.import_module("review3_pkg.hooks")
        if imported:
            importlib.import_module("review3_pkg.config")

        def change() -> None:
            monkeypatch.setattr(sys.modules["review3_pkg.config"], "GAIN", 3.0)

        _served_after_change(tmp_path, audio_dir, getattr(hooks, how), change)
    finally:
        for name in ("review3_pkg.hooks", "review3_pkg.config", "review3_pkg"):
            sys.modules.pop(name, None)


# -- a dict reached by getattr with a constant name ------------------------------------------------


def _dict_by_getattr(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (args[0] * getattr(THIS_MODULE, "SETTINGS")["gain"],)  # noqa: B009 - tested


def test_a_dict_of_the_users_module_read_by_getattr_is_keyed_by_its_items(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _served_after_change(
        tmp_path, audio_dir, _dict_by_getattr, lambda: monkeypatch.setitem(SETTINGS, "gain", 3.0)
    )


def test_a_module_kept_in_a_local_keeps_its_key_when_nothing_read_changes(
    tmp_path: Path, audio_dir: Path
) -> None:
    from tests.serve.test_watch_keys import _hooked

    module = _hooked(_module_in_local, pre=True)
    again = _baked_then_reopened(audio_dir, module, tmp_path)
    _assert_live(again, module, 1)
