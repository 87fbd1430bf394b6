"""Loading encoders: TorchScript, torch.export with dynamic shapes, import paths, pickles."""

from __future__ import annotations

import importlib
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from featbake.bake.pipeline import build
from featbake.encode.encoders import (
    EXPORT,
    IMPORT,
    PICKLE,
    TORCHSCRIPT,
    detect_kind,
    from_module,
    is_frozen,
)
from featbake.encode.loaders import load_encoder
from featbake.encode.outputs import split_outputs
from featbake.encode.sources import AudioSource, source_for
from featbake.errors import CacheMiss, ConfigError, EncodeError, EncoderLoadError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.testing import (
    MultiOutputEncoder,
    TinyConvEncoder,
    save_torchscript,
    write_audio_folder,
)
from tests.conftest import invoke, live_features

ENC_MODULE = textwrap.dedent(
    """
    import torch
    from featbake.testing import TinyConvEncoder

    def build(dim=64):
        return TinyConvEncoder(dim=dim, seed=123)

    def not_a_module():
        return 42
    """
)


def _eager(seed: int = 0) -> TinyConvEncoder:
    return TinyConvEncoder(seed=seed).eval()


def _stored(cache: Path, report) -> dict[str, dict[str, torch.Tensor]]:
    """path -> stored parts, read through the catalog."""
    reader = FeatureReader(Layout(cache))
    try:
        items = Catalog(Layout(cache)).root_items(report.root)
        return {p: reader.get(k) for p, k in items}
    finally:
        reader.close()


def export_dynamic(module: torch.nn.Module, path: Path) -> Path:
    """The documented export: batch and time both dynamic, named as forward's argument."""
    program = torch.export.export(
        module.eval(),
        (torch.randn(2, 16000),),
        dynamic_shapes={
            "wav": {0: torch.export.Dim("batch"), 1: torch.export.Dim("time", min=560)}
        },
    )
    torch.export.save(program, str(path))
    return path


# -- TorchScript ----------------------------------------------------------------------------------
def test_torchscript_loads_in_eval_mode_and_matches_eager(encoder_file: Path) -> None:
    enc = load_encoder(encoder_file)
    assert enc.kind == TORCHSCRIPT and detect_kind(encoder_file) == TORCHSCRIPT
    assert not enc.module.training
    assert enc.label == str(encoder_file.resolve())
    x = torch.randn(3, 4000)
    with torch.no_grad():
        assert torch.allclose(enc.run(x), _eager()(x), atol=1e-6)
    assert enc.run(x).is_inference()  # ran under torch.inference_mode()
    assert load_encoder(encoder_file).fingerprint == enc.fingerprint


def test_a_failing_batch_is_an_encode_error(encoder_file: Path) -> None:
    with pytest.raises(EncodeError, match=r"failed on a batch of shape \(1, 10\)"):
        load_encoder(encoder_file).run(torch.randn(1, 10))  # shorter than the conv kernel


# -- torch.export ---------------------------------------------------------------------------------
def test_export_with_dynamic_batch_and_time(tmp_path: Path, audio_dir: Path) -> None:
    path = export_dynamic(_eager(), tmp_path / "enc.pt2")
    enc = load_encoder(path)
    assert enc.kind == EXPORT and detect_kind(path) == EXPORT
    for shape in [(1, 560), (3, 12345), (5, 16000), (1, 48000)]:
        x = torch.randn(shape)
        with torch.no_grad():
            assert torch.allclose(enc.run(x), _eager()(x), atol=1e-5)
    # A whole build over clips of many lengths, checked against the eager module now.
    report = build(audio_dir, path, cache=tmp_path / "c", workers=0)
    assert report.ok and report.encoded == report.files == 16
    src = AudioSource(Recipe())
    for rel, parts in _stored(tmp_path / "c", report).items():
        with torch.no_grad():
            live = _eager()(src.load(audio_dir / rel).unsqueeze(0))[0]
        assert torch.allclose(parts[""], live, atol=1e-5), rel


def test_a_static_export_fails_per_item_with_the_guard(tmp_path: Path, audio_dir: Path) -> None:
    program = torch.export.export(_eager(), (torch.randn(1, 16000),))
    torch.export.save(program, str(tmp_path / "static.pt2"))
    report = build(audio_dir, tmp_path / "static.pt2", cache=tmp_path / "c", workers=0)
    # Only the 1 s clips match the exported shape; every other clip is named with the reason.
    assert report.encoded == 4
    assert len(report.failed) == 12
    assert all("Guard failed" in reason for _, reason in report.failed)


# -- import paths ---------------------------------------------------------------------------------
@pytest.fixture
def enc_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "tiny_enc_mod.py").write_text(ENC_MODULE)
    monkeypatch.syspath_prepend(str(pkg))
    return pkg


def test_import_path_with_safetensors_weights(tmp_path: Path, enc_module: Path) -> None:
    weights = tmp_path / "w.safetensors"
    save_file(TinyConvEncoder(seed=7).state_dict(), str(weights))
    enc = load_encoder("tiny_enc_mod:build", weights=weights)
    assert enc.kind == IMPORT and enc.label == "tiny_enc_mod:build"
    assert is_frozen(enc.module.requires_grad_(False))
    x = torch.randn(2, 3200)
    with torch.no_grad():
        assert torch.allclose(enc.run(x), _eager(seed=7)(x), atol=1e-6)
    bare = load_encoder("tiny_enc_mod:build")
    assert bare.fingerprint != enc.fingerprint  # the weights are in the fingerprint


GAIN_MODULE = textwrap.dedent(
    """
    import os

    import numpy as np
    import torch
    from featbake.testing import TinyConvEncoder


    class Gained(TinyConvEncoder):
        def __init__(self):
            super().__init__()
            gain = float(os.environ["FEATBAKE_TEST_GAIN"])
            self.register_buffer("gain", torch.tensor(gain), persistent=False)
            self.bank = torch.from_numpy(np.load(os.environ["FEATBAKE_TEST_BANK"]))

        def forward(self, wav):
            return super().forward(wav) * self.gain + self.bank


    def make():
        return Gained()
    """
)


@pytest.mark.parametrize("changed", ["buffer", "attribute"])
def test_a_buffer_or_tensor_its_factory_made_otherwise_is_a_new_import_path_encoder(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, changed: str
) -> None:
    """An import-path encoder's fingerprint was cached against its identity and its weights
    file alone: a non-persistent buffer (a gain read from the environment) or a tensor
    attribute (a filter bank read from a file beside the code) its factory made otherwise
    kept the old fingerprint, so the rebuild reused every item and the dataset served the old
    features (1.5x off). What the weights file does not hold is in the cache's id now."""
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "gain_enc_mod.py").write_text(GAIN_MODULE)
    monkeypatch.syspath_prepend(str(pkg))
    bank = tmp_path / "bank.npy"
    np = pytest.importorskip("numpy")
    np.save(bank, np.zeros(64, dtype=np.float32))
    monkeypatch.setenv("FEATBAKE_TEST_GAIN", "2")
    monkeypatch.setenv("FEATBAKE_TEST_BANK", str(bank))
    weights = tmp_path / "w.safetensors"
    save_file(TinyConvEncoder(seed=7).state_dict(), str(weights))
    monkeypatch.setattr("featbake.store.hash_cache.RACY_NS", 0)  # its fingerprint is cached
    store = tmp_path / "c"
    first = build(audio_dir, "gain_enc_mod:make", weights=weights, cache=store, workers=0)
    if changed == "buffer":
        monkeypatch.setenv("FEATBAKE_TEST_GAIN", "3")
    else:
        np.save(bank, np.full(64, 0.25, dtype=np.float32))
    again = build(audio_dir, "gain_enc_mod:make", weights=weights, cache=store, workers=0)
    assert first.encoded == again.encoded == again.files == 16
    from featbake.serve.dataset import CachedFeatureDataset

    ds = CachedFeatureDataset(
        audio_dir, encoder="gain_enc_mod:make", weights=weights, cache=store, on_miss="error"
    )
    live = load_encoder("gain_enc_mod:make", weights=weights)
    src = AudioSource(Recipe())
    for i in range(len(ds)):
        with torch.no_grad():
            want = live.run(src.load(Path(ds.path(i))).unsqueeze(0))[0]
        got = ds[i]  # stored as float16: its rounding
        torch.testing.assert_close(got, want.to(got.dtype), atol=2e-3, rtol=2e-3)


def test_import_path_errors(tmp_path: Path, enc_module: Path, encoder_file: Path) -> None:
    with pytest.raises(EncoderLoadError, match="PYTHONPATH"):
        load_encoder("no_such_module_xyz:build")
    with pytest.raises(EncoderLoadError, match="factory name"):
        load_encoder("tiny_enc_mod:nope")
    with pytest.raises(EncoderLoadError, match=r"not an nn\.Module"):
        load_encoder("tiny_enc_mod:not_a_module")
    with pytest.raises(EncoderLoadError, match="does not exist"):
        load_encoder("tiny_enc_mod:build", weights=tmp_path / "missing.safetensors")
    wrong = tmp_path / "wrong.safetensors"
    save_file(TinyConvEncoder(dim=8).state_dict(), str(wrong))
    with pytest.raises(EncoderLoadError, match="do not fit"):
        load_encoder("tiny_enc_mod:build", weights=wrong)
    with pytest.raises(ConfigError, match="import-path"):
        load_encoder(encoder_file, weights=wrong)


def test_cli_builds_an_import_path_encoder_with_weights(tmp_path: Path, audio_dir: Path) -> None:
    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "tiny_enc_mod.py").write_text(ENC_MODULE)
    weights = tmp_path / "w.safetensors"
    save_file(TinyConvEncoder(seed=7).state_dict(), str(weights))
    repo = Path(__file__).resolve().parents[2]
    args = ["build", "-e", "tiny_enc_mod:build", "--weights", weights, "-d", audio_dir]
    res = invoke(*args, "--cache", tmp_path / "c", "--json", env={"PYTHONPATH": f"{repo}:{pkg}"})
    assert res.returncode == 0, res.stderr
    src = AudioSource(Recipe())
    import json

    report = json.loads(res.stdout)
    assert report["encoded"] == 16
    stored = Catalog(Layout(tmp_path / "c")).root_items(report["root"])
    reader = FeatureReader(Layout(tmp_path / "c"))
    for rel, key in stored:
        with torch.no_grad():
            live = _eager(seed=7)(src.load(audio_dir / rel).unsqueeze(0))[0]
        assert torch.allclose(reader.get(key)[""], live, atol=1e-6)


def test_the_console_script_finds_an_import_path_encoder_in_the_current_folder(
    tmp_path: Path, audio_dir: Path
) -> None:
    """Issue 18 item 2: `featbake build --encoder examples.x:make` failed from the folder that
    holds examples/ ("No module named 'examples'"), while `python -m featbake` worked: the
    console script's sys.path has its bin folder, not the current one (the build now runs in a
    `python -m featbake` child, and import paths also resolve from the current folder)."""
    import json
    import os
    import subprocess

    project = tmp_path / "project"
    (project / "examples").mkdir(parents=True)
    (project / "examples" / "__init__.py").write_text("")
    (project / "examples" / "tiny_enc_mod.py").write_text(ENC_MODULE)
    script = Path(sys.executable).with_name("featbake")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    args = ["build", "-e", "examples.tiny_enc_mod:build", "-d", audio_dir, "--cache", "c"]
    res = subprocess.run(
        [str(script), *map(str, args), "--json"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["encoded"] == 16
    reader = FeatureReader(Layout(project / "c"))
    src = AudioSource(Recipe())
    for rel, key in Catalog(Layout(project / "c")).root_items(report["root"]):
        with torch.no_grad():
            live = TinyConvEncoder(seed=123).eval()(src.load(audio_dir / rel).unsqueeze(0))[0]
        assert torch.allclose(reader.get(key)[""], live, atol=1e-6)
    # A module that is nowhere still names what is missing.
    res = subprocess.run(
        [str(script), "build", "-e", "nowhere_mod:build", "-d", str(audio_dir)],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode != 0 and "No module named 'nowhere_mod'" in res.stderr


TRAIN_SCRIPT = """\
import sys
import torch
from featbake import CachedFeatureDataset
ds = CachedFeatureDataset(sys.argv[1], "examples.tiny_enc_mod:build", cache=sys.argv[2])
torch.save({"n": len(ds), "path": ds.path(3), "feature": ds[3]}, sys.argv[3])
"""


def test_a_training_script_in_a_subfolder_finds_an_import_path_encoder_in_the_current_folder(
    tmp_path: Path, audio_dir: Path
) -> None:
    """`python scripts/train.py` from the project root has scripts/ on sys.path, not the root:
    the dataset's import-path encoder resolved only with PYTHONPATH set (issue 18 item 2)."""
    import os
    import subprocess

    project = tmp_path / "project"
    (project / "examples").mkdir(parents=True)
    (project / "scripts").mkdir()
    (project / "examples" / "__init__.py").write_text("")
    (project / "examples" / "tiny_enc_mod.py").write_text(ENC_MODULE)
    (project / "scripts" / "train.py").write_text(TRAIN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "served.pt"
    res = subprocess.run(
        [sys.executable, "scripts/train.py", str(audio_dir), str(tmp_path / "c"), str(out)],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    served = torch.load(out)
    assert served["n"] == 16
    with torch.no_grad():  # the encoder run now, on that file
        live = TinyConvEncoder(seed=123).eval()(
            AudioSource(Recipe()).load(served["path"]).unsqueeze(0)
        )[0]
    torch.testing.assert_close(served["feature"], live)


# -- pickles --------------------------------------------------------------------------------------
def test_a_pickled_module_is_refused_unless_trusted(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save(_eager(), path)
    assert detect_kind(path) == PICKLE
    with pytest.raises(EncoderLoadError, match=r"runs arbitrary code.*--trust-pickle"):
        load_encoder(path)
    enc = load_encoder(path, trust_pickle=True)
    assert enc.kind == PICKLE and not enc.module.training
    x = torch.randn(1, 1600)
    with torch.no_grad():
        assert torch.equal(enc.run(x), _eager()(x))


def test_cli_refuses_a_pickle_with_exit_4_and_accepts_it_when_trusted(
    tmp_path: Path, audio_dir: Path
) -> None:
    path = tmp_path / "model.pt"
    torch.save(_eager(), path)
    res = invoke("build", "-e", path, "-d", audio_dir, "--cache", tmp_path / "c")
    assert res.returncode == 4
    assert "--trust-pickle" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "c" / "shards").exists() or not any((tmp_path / "c").rglob("*.st*"))
    ok = invoke("build", "-e", path, "-d", audio_dir, "--cache", tmp_path / "c", "--trust-pickle")
    assert ok.returncode == 0, ok.stderr


def test_a_state_dict_file_gets_the_helpful_message(tmp_path: Path) -> None:
    path = tmp_path / "weights.pt"
    torch.save(_eager().state_dict(), path)
    with pytest.raises(EncoderLoadError, match=r"state dict.*--weights weights\.safetensors"):
        load_encoder(path)


def test_a_garbage_file_is_not_called_a_pickle(tmp_path: Path) -> None:
    path = tmp_path / "enc.pt"
    path.write_bytes(b"definitely not a model" * 10)
    with pytest.raises(EncoderLoadError, match="is not a TorchScript") as e:
        load_encoder(path)
    assert "--trust-pickle" not in str(e.value)
    with pytest.raises(EncoderLoadError, match="not found"):
        load_encoder(tmp_path / "missing.pt")


# -- outputs --------------------------------------------------------------------------------------
def test_split_outputs() -> None:
    a, b = torch.zeros(2, 3), torch.ones(2)
    assert split_outputs(a, None) == {"": a}
    assert split_outputs((a, b), None) == {"0": a, "1": b}
    assert split_outputs({"h": a, "p": b}, "p") == {"": b}
    assert split_outputs((a, b), "1") == {"": b}
    with pytest.raises(ConfigError, match=r"no output 'x'.*'h', 'p'"):
        split_outputs({"h": a, "p": b}, "x")
    with pytest.raises(EncodeError, match="pick a tensor output"):
        split_outputs({"h": a, "n": 3}, None)
    with pytest.raises(EncodeError, match="returned int"):
        split_outputs(3, None)


def test_multi_output_stores_every_part_and_output_selects_one(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path
) -> None:
    report = build(audio_dir, multi_encoder_file, cache=tmp_path / "all", workers=0)
    assert report.ok
    for rel, parts in _stored(tmp_path / "all", report).items():
        live = live_features(multi_encoder_file, audio_dir / rel)
        assert set(parts) == {"hidden", "pooled"} == set(live)
        for name in parts:
            assert torch.allclose(parts[name], live[name], atol=1e-6)
    recipe = Recipe(output="pooled")
    one = build(audio_dir, multi_encoder_file, cache=tmp_path / "all", recipe=recipe, workers=0)
    # A new recipe, new keys; the parts the whole-output build stored are copied, not encoded.
    assert (one.encoded, one.derived) == (0, 16) and one.root != report.root
    for rel, parts in _stored(tmp_path / "all", one).items():
        assert set(parts) == {""}
        live = live_features(multi_encoder_file, audio_dir / rel, recipe)
        assert torch.allclose(parts[""], live, atol=1e-6)
    with pytest.raises(ConfigError, match="no output 'zz'"):  # the option is wrong, not the inputs
        build(audio_dir, multi_encoder_file, cache=tmp_path / "x", recipe=Recipe(output="zz"))


def test_from_module_puts_the_module_in_eval_mode() -> None:
    m = MultiOutputEncoder().train()
    enc = from_module(m)
    assert not m.training and enc.kind == "module" and enc.device == torch.device("cpu")


class _RaisesOnLong(torch.nn.Module):
    """Raises for inputs longer than 8,000 samples (scriptable: a TorchScript ``raise``)."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if wav.shape[1] > 8000:
            raise ValueError("clip longer than half a second")
        return wav[:, :10]


def test_a_torchscript_raise_is_an_encode_error_that_shows_its_cause(tmp_path: Path) -> None:
    from featbake.testing import save_torchscript

    enc = load_encoder(save_torchscript(_RaisesOnLong(), tmp_path / "raises.pt"))
    assert enc.run(torch.zeros(1, 100)).shape == (1, 10)
    with pytest.raises(EncodeError) as info:
        enc.run(torch.zeros(1, 9000))
    assert "clip longer than half a second" in str(info.value)
    assert "The following operation failed" not in str(info.value)


def test_any_exception_from_the_encoder_is_an_encode_error_naming_it() -> None:
    class KeyErrorEncoder(torch.nn.Module):
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            return {"a": wav}["missing"]

    with pytest.raises(EncodeError, match="KeyError: 'missing'"):
        from_module(KeyErrorEncoder()).run(torch.zeros(1, 10))


def test_sys_exit_inside_an_encoder_is_a_load_error_not_a_silent_exit() -> None:
    class Exits(torch.nn.Module):
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            raise SystemExit(3)

    with pytest.raises(EncoderLoadError, match=r"called sys\.exit\(3\)"):
        from_module(Exits()).run(torch.zeros(1, 10))


def test_a_complex_output_is_refused_not_cast_to_its_real_part() -> None:
    class Spectrum(torch.nn.Module):
        def forward(self, wav: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"real": wav, "spec": torch.fft.rfft(wav)}

    with pytest.raises(EncodeError, match=r"complex output 'spec' \(torch.complex64\)"):
        from_module(Spectrum()).run(torch.zeros(1, 16))


def test_random_bytes_as_an_encoder_never_relay_torchs_weights_only_advice(
    tmp_path: Path,
) -> None:
    path = tmp_path / "random.pt"
    path.write_bytes(bytes(range(256)) * 16)
    with pytest.raises(EncoderLoadError) as info:
        load_encoder(path)
    message = str(info.value)
    assert "is not a TorchScript (.pt), torch.export (.pt2) or torch.save file" in message
    assert "weights_only" not in message and "arbitrary code" not in message


@pytest.mark.parametrize("seed", [0, 2])
def test_random_bytes_get_one_message_whatever_the_unpickler_trips_on(
    tmp_path: Path, seed: int
) -> None:
    """Seed 0 trips torch's weights-only unpickler (UnpicklingError), seed 2 an IndexError deep
    inside it: both are "not a TorchScript (.pt), ..." (before, 1 in 12 random files got other
    words, which made the CLI test of item 19 flaky)."""
    import random

    path = tmp_path / "model.pt"
    path.write_bytes(random.Random(seed).randbytes(4096))
    with pytest.raises(EncoderLoadError) as info:
        load_encoder(path)
    message = str(info.value)
    assert "is not a TorchScript (.pt), torch.export (.pt2) or torch.save file" in message
    assert "check the path, or that the file is complete" in message
    assert "weights_only" not in message


def test_an_import_path_module_calling_sys_exit_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "exits_in_factory.py").write_text("import sys\ndef build():\n    sys.exit(3)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(EncoderLoadError, match=r"importing exits_on_import called sys\.exit"):
            load_encoder("exits_on_import:build")
        with pytest.raises(EncoderLoadError, match=r"build\(\) called sys\.exit\(3\)"):
            load_encoder("exits_in_factory:build")
    finally:
        sys.path.remove(str(tmp_path))


class _FilterBank(torch.nn.Module):
    """A front-end whose only state is a buffer (a mel filter bank)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bank", torch.ones(160, 8))

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return wav[:, :160] @ self.bank


def test_from_module_runs_a_module_of_buffers_only_where_its_buffers_are() -> None:
    """``from_module`` chose the first parameter's device, else the CPU, while the dataset's
    watch (``module_device``) took the first parameter's, else the first buffer's: a front-end
    whose only state is a buffer, on another device, was moved to the CPU by the dataset (the
    user's own module) and failed on the meta device with torch's ``Cannot copy out of meta
    tensor``. One function decides both now: the module stays where its buffers are."""
    bank = _FilterBank().to("meta")
    enc = from_module(bank)
    from featbake.encode.encoders import module_device

    assert enc.device == module_device(bank) == torch.device("meta")
    assert bank.bank.is_meta and enc.module is bank
    out = enc.run(torch.ones(2, 160))  # inputs sent where the weights are
    assert out.shape == (2, 8) and out.is_meta
    assert module_device(torch.nn.ReLU()) is None
    assert from_module(torch.nn.ReLU()).device == torch.device("cpu")


class PooledBesideTokens(torch.nn.Module):
    """A lengths-protocol encoder returning its frames and a per-clip masked mean (and, with
    ``queries``, a part of a fixed 5 rows per clip): what a TorchScript user writes."""

    def __init__(self, queries: bool = False, dim: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, dim, 400, stride=320)
        self.queries = queries

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x = torch.tanh(self.conv(wav.unsqueeze(1))).transpose(1, 2)
        out = torch.div(lengths - 400, 320, rounding_mode="floor") + 1
        mask = (torch.arange(x.shape[1])[None, :] < out[:, None]).to(x.dtype)
        pooled = (x * mask[..., None]).sum(1) / out[:, None].to(x.dtype)
        parts = {"tokens": x, "pooled": pooled}
        if self.queries:
            parts["queries"] = pooled[:, None, :].expand(-1, 5, -1) * 2
        return parts, out


def test_a_per_clip_pooled_beside_the_frames_is_kept_whole(tmp_path: Path) -> None:
    """A TorchScript encoder taking lengths and returning ``{"tokens": [B, T', D], "pooled":
    [B, D]}``: ``pooled`` was cut to each clip's frame count (24, 37, 49 of its 64 values)
    and served so, the build saying nothing. Each part is checked against the module run now
    on the clip alone."""
    data = tmp_path / "clips"
    write_audio_folder(data, 4, seconds=(0.5, 1.0), seed=3)
    path = tmp_path / "pooled.pt"
    torch.jit.save(torch.jit.script(PooledBesideTokens().eval()), str(path))
    report = build(data, path, cache=tmp_path / "s", workers=0, batching="padded")
    assert report.ok and report.encoded == 4
    ds = CachedFeatureDataset(data, path, cache=tmp_path / "s", on_miss="error")
    module = torch.jit.load(str(path))
    for i in range(len(ds)):
        wav = AudioSource(Recipe()).load(ds.path(i))[None]
        with torch.inference_mode():
            want, _ = module(wav, torch.tensor([wav.shape[1]]))
        got = ds[i]
        assert got["pooled"].shape == (64,)
        torch.testing.assert_close(got["pooled"], want["pooled"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["tokens"], want["tokens"][0], atol=1e-5, rtol=1e-5)


def test_a_part_of_other_rows_than_the_frames_is_refused_not_cut(tmp_path: Path) -> None:
    """A part of 5 rows per clip beside the frames (``[B, 5, D]``) was cut to the 2 frames of
    a short clip as if it were frames; it fails the item in one line naming the parts now."""
    data = tmp_path / "clips"
    write_audio_folder(data, 2, seconds=0.05, seed=3)
    path = tmp_path / "queries.pt"
    torch.jit.save(torch.jit.script(PooledBesideTokens(queries=True).eval()), str(path))
    report = build(data, path, cache=tmp_path / "s", workers=0, batching="padded")
    assert report.encoded == 0 and len(report.failed) == 2
    said = report.failed[0][1]
    assert "differ in their frames" in said and "queries" in said and "\n" not in said


def test_a_negative_output_length_is_said_not_taken_for_inexact_padding() -> None:
    """An ``out_lengths`` formula giving -1 for a short clip stored it as an empty item and
    the guard blamed padding; the length is refused in one line saying what to fix."""
    from featbake.encode.encoders import trim_rows

    frames = {"tokens": torch.zeros(2, 3, 4)}
    with pytest.raises(EncodeError, match="negative output length \\(-1\\)") as refused:
        trim_rows(frames, torch.tensor([3, -1]), lambda t: t)
    assert "\n" not in str(refused.value)


IMAGE_MODULE = textwrap.dedent(
    """
    import torch

    def build():
        torch.manual_seed(0)
        conv = torch.nn.Conv2d(3, 4, 8, 8)
        return torch.nn.Sequential(conv, torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten())
    """
)


def _suggested_build(miss: CacheMiss) -> list[str]:
    """The `featbake build` command a CacheMiss tells the user to run, as its arguments."""
    command = str(miss).split("Run `", 1)[1].split("`", 1)[0]
    words = shlex.split(command)
    assert words[:2] == ["featbake", "build"], command
    return words[1:]


@pytest.mark.parametrize("kind", ["weights", "image"])
def test_the_build_a_miss_suggests_builds_what_the_dataset_reads(
    tmp_path: Path, audio_dir: Path, kind: str
) -> None:
    """A dataset's CacheMiss names the `featbake build` command to run: it left out
    `--weights` (the command built the factory's own weights, and the dataset missed again)
    and the image steps the dataset was given (`crop=128x96`: the command built the default
    224 crop, and the dataset missed again). Run as printed now, it builds what the dataset
    reads, served as the encoder gives it now."""
    from featbake.image_recipe import ImageRecipe, Size
    from featbake.testing import write_image_folder

    pkg = tmp_path / "pkgs"
    pkg.mkdir()
    (pkg / "tiny_enc_mod.py").write_text(ENC_MODULE)
    (pkg / "tiny_img_mod.py").write_text(IMAGE_MODULE)
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": f"{repo}:{pkg}"}
    cache = tmp_path / "store"
    if kind == "weights":
        weights = tmp_path / "my weights" / "w.safetensors"  # a space: the command quotes it
        weights.parent.mkdir()
        save_file(TinyConvEncoder(seed=7).state_dict(), str(weights))
        data, spec, recipe, extra = audio_dir, "tiny_enc_mod:build", Recipe(), {"weights": weights}
    else:
        data = tmp_path / "images"
        write_image_folder(data, 3, size=(160, 200))
        steps = ImageRecipe(  # rescale 1, an int: the command line's 1.0 is the same key
            crop=Size(128, 96), rescale=1, mean=(127.5,) * 3, std=(64.0,) * 3
        )
        spec, recipe, extra = "tiny_img_mod:build", Recipe(source="image", image=steps), {}
    sys.path[:0] = [str(pkg)]
    try:

        def dataset() -> CachedFeatureDataset:
            return CachedFeatureDataset(
                data, spec, cache=cache, recipe=recipe, on_miss="error", **extra
            )

        other = tmp_path / "other"
        write_audio_folder(other, 2, seconds=0.5, seed=9)
        build(other, save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt"), cache=cache)
        ds = dataset()
        with pytest.raises(CacheMiss) as missed:
            ds[0]
        built = invoke(*_suggested_build(missed.value), env=env)
        assert built.returncode == 0, built.stderr
        ds = dataset()
        module = _eager(seed=7) if kind == "weights" else importlib.import_module("tiny_img_mod")
        module = module.eval() if kind == "weights" else module.build().eval()
        for i in range(len(ds)):
            with torch.inference_mode():
                live = module(source_for(recipe).load(Path(ds.path(i))).unsqueeze(0))[0]
            torch.testing.assert_close(ds[i], live)
    finally:
        sys.path.remove(str(pkg))
