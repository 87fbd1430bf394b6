"""An import-path encoder's key covers the user's own code it imports, not only the factory's."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from featbake.encode.identity import CodeClosure, imported_names
from featbake.encode.sources import source_for
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import write_audio_folder
from tests.conftest import REPO, invoke

MOD = textwrap.dedent(
    """
    import torch
    from pkg.other import helper

    class Enc(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv1d(1, 4, 5, stride=4)

        def forward(self, wav):
            return helper(self.conv(wav.unsqueeze(1)).transpose(1, 2))

    def make():
        return Enc()
    """
)


def _package(root: Path, factor: str) -> Path:
    (root / "pkg").mkdir(parents=True, exist_ok=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(MOD)
    (root / "pkg" / "other.py").write_text(f"def helper(x):\n    return x * {factor}\n")
    (root / "pkg" / "extra.py").write_text("VALUE = 1\n")  # not imported by the encoder
    return root


def _fingerprint(root: Path, preload: str = "") -> str:
    code = f"{preload}\nfrom featbake.encode.loaders import load_encoder\n"
    code += "print(load_encoder('pkg.mod:make').fingerprint)"
    env = {"PYTHONPATH": f"{REPO}:{root}", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def test_editing_a_helper_module_rebakes_and_serves_the_new_features(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _package(tmp_path / "src", "2.0")
    data = tmp_path / "audio"
    write_audio_folder(data, 4, seconds=0.3, seed=41)
    env = {"PYTHONPATH": f"{REPO}:{root}"}
    args = ["build", "-e", "pkg.mod:make", "-d", data, "--cache", tmp_path / "c", "--json"]
    first = json.loads(invoke(*args, env=env).stdout)
    again = json.loads(invoke(*args, env=env).stdout)  # another process, nothing changed
    assert (first["encoded"], again["encoded"], again["reused"]) == (4, 0, 4)
    assert again["encoder_fp"] == first["encoder_fp"]

    (root / "pkg" / "other.py").write_text("def helper(x):\n    return x * 3.0\n")
    edited = json.loads(invoke(*args, env=env).stdout)
    assert edited["encoder_fp"] != first["encoder_fp"] and edited["encoded"] == 4

    monkeypatch.syspath_prepend(str(root))
    for name in ("pkg", "pkg.mod", "pkg.other"):
        sys.modules.pop(name, None)
    ds = CachedFeatureDataset(data, "pkg.mod:make", cache=tmp_path / "c", on_miss="error")
    enc = importlib.import_module("pkg.mod").make().eval()
    src = source_for(Recipe())
    for i in range(len(ds)):
        with torch.no_grad():
            live = enc(src.load(ds.path(i)).unsqueeze(0))[0]
        torch.testing.assert_close(ds[i], live, rtol=1e-5, atol=1e-6)
    for name in ("pkg", "pkg.mod", "pkg.other"):
        sys.modules.pop(name, None)


def test_the_identity_is_the_same_in_every_process_whatever_it_imported(tmp_path: Path) -> None:
    root = _package(tmp_path / "src", "2.0")
    fp = _fingerprint(root)
    assert _fingerprint(root, "import pkg.extra") == fp  # a training script imports more
    (root / "pkg" / "extra.py").write_text("VALUE = 2\n")
    assert _fingerprint(root) == fp  # code the encoder does not import is not in its key
    moved = root.rename(tmp_path / "moved")  # paths are not in the key, contents are
    assert _fingerprint(moved) == fp


def test_the_closure_follows_relative_and_absolute_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "top" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "top" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from ..b import g\nfrom . import c\nimport numpy\n")
    (tmp_path / "top" / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    names = set(imported_names(pkg / "a.py", "top.sub"))
    assert names == {"top.b", "top.b.g", "top.sub", "top.sub.c", "numpy"}
    sys.path.insert(0, str(tmp_path))
    try:
        closure = CodeClosure()
        closure.add("top.sub")
    finally:
        sys.path.remove(str(tmp_path))
    assert set(closure.sources) == {"top", "top.sub", "top.sub.a", "top.b", "top.sub.c"}
    assert closure.libraries["numpy"].startswith("numpy==")


def _holding(value: object) -> object:
    """A pre-hook closing over ``value`` (what it does with it does not matter here)."""

    def hook(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        print(value)

    return hook


class _Opaque:
    """An object with no attributes whose repr is its address: no value to key."""

    __slots__ = ()


def test_what_a_hook_holds_is_keyed_by_value_or_refused_never_by_its_type_alone() -> None:
    """Round ten's rule for a held value (``HeldReading``): values differing only in what
    they hold key apart (a numpy scalar, a dict, a lambda's constant, a ``torch.dtype``); a
    logger is keyed by its name, a lock by its kind; what has no value to key (an object whose
    repr is its address) or is too large to key is refused, as tensors and modules are. Before
    round ten each of these was keyed by its type alone."""
    import logging
    import threading

    import numpy as np

    from featbake.encode.identity import HELD_VALUES, held_refusals, held_values

    pairs = [
        (np.float32(2.0), np.float32(3.0)),
        ({"factor": 2.0}, {"factor": 3.0}),
        (lambda x: x * 2.0, lambda x: x * 3.0),
        (torch.float16, torch.bfloat16),
        (logging.getLogger("a"), logging.getLogger("b")),
    ]
    for a, b in pairs:
        assert held_values(_holding(a)) != held_values(_holding(b)), (a, b)
        assert held_refusals(_holding(a)) == []
    assert held_values(_holding(np.float32(2.0))) == held_values(_holding(2.0))
    opaque = held_refusals(_holding(_Opaque()))
    assert opaque and "address" in opaque[0]
    assert held_refusals(_holding(threading.Lock())) == []  # r12.8: a lock changes no output
    assert held_values(_holding(threading.Lock())) == held_values(_holding(threading.Lock()))
    assert held_refusals(_holding(torch.zeros(1)))[0] == "a value (Tensor)"
    assert "too large" in held_refusals(_holding(list(range(HELD_VALUES + 1))))[0]


# == one key for one hook in every process (serve10.10) ==========================================
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


def _scaled_by_deque(factors: Any, module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    return (args[0] * factors[0],)


# == containers read by their repr ================================================================
def test_a_tensor_inside_a_deque_a_hook_holds_is_refused_as_inside_a_list() -> None:
    import collections

    from featbake.encode.identity import held_refusals

    gains = torch.ones(2000)
    hook = functools.partial(_scaled_by_deque, collections.deque([gains]))
    assert held_refusals(hook), "a tensor inside a deque was neither refused nor keyed"


_SENTINEL = object()


def _sentinel_default(module: Any, args: Any, missing: Any = _SENTINEL) -> None:
    return None


def test_standard_value_types_and_sentinels_are_keyed_by_value_never_refused() -> None:
    """Decimal, Path, datetime, UUID keep their value in private slots: keyed by their repr,
    one per value; a sentinel ``object()`` default as its type (no address), not refused."""
    import datetime
    import decimal
    import uuid

    from featbake.encode.identity import held_refusals, held_values

    values = [
        decimal.Decimal("1.5"),
        Path("/a/b"),
        datetime.date(2020, 1, 2),
        datetime.timedelta(seconds=3),
        uuid.UUID(int=5),
    ]
    for value in values:
        hook = functools.partial(_scaled_by_deque, value)
        assert not held_refusals(hook)
        assert held_values(hook) != held_values(functools.partial(_scaled_by_deque, None))
    assert held_values(functools.partial(_scaled_by_deque, decimal.Decimal("2"))) != held_values(
        functools.partial(_scaled_by_deque, decimal.Decimal("3"))
    )
    assert not held_refusals(_sentinel_default)
    assert "0x" not in held_values(_sentinel_default)[0]
