"""Keys change with what goes in, and with nothing else (HF datasets #2496 and #8439)."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from featbake.bake.pipeline import build
from featbake.encode.fingerprints import cached_file_encoder_fp, file_fingerprint
from featbake.encode.loaders import load_encoder
from featbake.encode.sources import source_for
from featbake.keys import (
    WEIGHT_CHUNK_BYTES,
    canonical_json,
    derived_attributes,
    feature_key,
    module_fingerprint,
    root_id,
    state_dict_fingerprint,
    tensor_attributes,
)
from featbake.recipe import Recipe
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder


def _manifest(cache: Path, root: str) -> dict[str, str]:
    cat = Catalog(Layout(cache))
    try:
        return dict(cat.root_items(root))
    finally:
        cat.close()


# -- canonical JSON --------------------------------------------------------------------------
def test_canonical_json_is_order_and_whitespace_free() -> None:
    a = {"b": [1, 2.5, None], "a": {"y": True, "x": "é"}}
    b = {"a": {"x": "é", "y": True}, "b": [1, 2.5, None]}
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) == b'{"a":{"x":"\\u00e9","y":true},"b":[1,2.5,null]}'


def test_canonical_json_refuses_nan() -> None:
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})


def test_feature_key_is_sha256_of_the_three_fingerprints() -> None:
    e, r, i = "a" * 64, "b" * 64, "c" * 64
    assert feature_key(e, r, i) == hashlib.sha256(f"{e}|{r}|{i}".encode()).hexdigest()
    assert len({feature_key(e, r, i), feature_key(r, e, i), feature_key(e, r, "d" * 64)}) == 3


def test_root_id_depends_on_data_encoder_and_recipe() -> None:
    base = root_id("/d", "enc.pt", "0" * 64)
    assert base == root_id("/d", "enc.pt", "0" * 64)
    assert len({base, root_id("/e", "enc.pt", "0" * 64), root_id("/d", "x.pt", "0" * 64)}) == 3
    assert root_id("/d", "enc.pt", "1" * 64) != base


# -- inputs --------------------------------------------------------------------------------------
def test_one_input_byte_changes_the_input_fingerprint(tmp_path: Path) -> None:
    p = tmp_path / "x.bin"
    data = bytearray(os.urandom(3 * 1024 * 1024 + 7))
    p.write_bytes(data)
    assert file_fingerprint(p) == hashlib.sha256(data).hexdigest()
    data[2 * 1024 * 1024 + 3] ^= 1
    p.write_bytes(data)
    assert file_fingerprint(p) == hashlib.sha256(data).hexdigest()


def test_rename_copy_and_touch_keep_keys_and_encode_nothing(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "cache"
    first = build(audio_dir, encoder_file, cache=cache, workers=0)
    keys = _manifest(cache, first.root)
    victim = next(p for p in sorted(keys) if p.startswith("part0/"))
    moved = audio_dir / "renamed.wav"
    os.rename(audio_dir / victim, moved)
    shutil.copy(audio_dir / "fixed" / "clip00000.wav", audio_dir / "copy.wav")
    touched = audio_dir / "fixed" / "clip00001.wav"
    st = touched.stat()
    os.utime(touched, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))

    again = build(audio_dir, encoder_file, cache=cache, workers=0)
    assert again.root == first.root
    assert again.encoded == 0
    assert again.duplicates == 1  # copy.wav shares its original's feature
    after = _manifest(cache, again.root)
    assert after["renamed.wav"] == keys[victim]
    assert after["copy.wav"] == keys["fixed/clip00000.wav"]
    assert after["fixed/clip00001.wav"] == keys["fixed/clip00001.wav"]


def test_one_changed_byte_of_audio_changes_its_key_only(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    cache = tmp_path / "cache"
    first = build(audio_dir, encoder_file, cache=cache, workers=0)
    before = _manifest(cache, first.root)
    target = audio_dir / "fixed" / "clip00002.wav"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0x01  # the last sample's low bit: still valid audio
    target.write_bytes(raw)
    again = build(audio_dir, encoder_file, cache=cache, workers=0)
    after = _manifest(cache, again.root)
    changed = {p for p in before if before[p] != after[p]}
    assert changed == {"fixed/clip00002.wav"}
    assert again.encoded == 1


def test_identical_files_share_one_feature(tmp_path: Path, encoder_file: Path) -> None:
    data = tmp_path / "dup"
    data.mkdir()
    clip = (np.sin(np.arange(16000) / 7.0) * 0.3).astype(np.float32)
    for name in ("a.wav", "b.wav", "sub/c.wav"):
        (data / name).parent.mkdir(exist_ok=True)
        soundfile.write(data / name, clip, 16000)
    report = build(data, encoder_file, cache=tmp_path / "c", workers=0)
    assert (report.files, report.encoded, report.duplicates) == (3, 1, 2)
    items = _manifest(tmp_path / "c", report.root)
    assert len(set(items.values())) == 1
    cat = Catalog(Layout(tmp_path / "c"))
    assert cat.conn.execute("SELECT COUNT(*) FROM features").fetchone() == (1,)
    cat.close()


# -- runtime options never enter a key ----------------------------------------------------------
def test_batch_size_workers_and_device_do_not_change_keys(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    a = build(audio_dir, encoder_file, cache=tmp_path / "a", batch_size=1, workers=0, device="cpu")
    b = build(
        audio_dir,
        encoder_file,
        cache=tmp_path / "b",
        batch_size=7,
        workers=2,
        device=torch.device("cpu"),
    )
    assert (a.root, a.encoder_fp, a.recipe_fp) == (b.root, b.encoder_fp, b.recipe_fp)
    assert _manifest(tmp_path / "a", a.root) == _manifest(tmp_path / "b", b.root)
    # And into the same store: a rerun with other runtime options reuses everything.
    c = build(audio_dir, encoder_file, cache=tmp_path / "a", batch_size=3, workers=1)
    assert (c.encoded, c.reused) == (0, a.encoded)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_cpu_give_the_same_keys(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    a = build(audio_dir, encoder_file, cache=tmp_path / "a", device="cpu", workers=0)
    b = build(audio_dir, encoder_file, cache=tmp_path / "b", device="cuda", workers=0)
    assert a.encoder_fp == b.encoder_fp
    assert _manifest(tmp_path / "a", a.root) == _manifest(tmp_path / "b", b.root)


# -- the encoder fingerprint --------------------------------------------------------------------
def _fp(path: Path) -> str:
    return load_encoder(path).fingerprint


def test_one_weight_changes_the_encoder_fingerprint(tmp_path: Path) -> None:
    model = TinyConvEncoder()
    base = _fp(save_torchscript(model, tmp_path / "a.pt"))
    assert _fp(save_torchscript(TinyConvEncoder(), tmp_path / "same.pt")) == base
    with torch.no_grad():
        model.conv2.bias[5] += 1e-6
    assert _fp(save_torchscript(model, tmp_path / "b.pt")) != base


def test_architecture_changes_the_encoder_fingerprint(tmp_path: Path) -> None:
    class Other(TinyConvEncoder):
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            x = torch.nn.functional.gelu(self.conv1(wav.unsqueeze(1)))
            return torch.nn.functional.relu(self.conv2(x)).transpose(1, 2)

    a = _fp(save_torchscript(TinyConvEncoder(), tmp_path / "a.pt"))
    b = _fp(save_torchscript(Other(), tmp_path / "b.pt"))
    assert a != b


def test_import_path_fingerprint_covers_the_code(tmp_path: Path, monkeypatch) -> None:
    """Editing forward() of an import-path encoder must change its key (same weights, repr)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    src = textwrap.dedent(
        """
        import torch
        class Enc(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)
            def forward(self, x):
                return self.lin(x){tail}
        def build():
            torch.manual_seed(0)
            return Enc()
        """
    )
    fps = []
    for tail in ["", " * 2"]:
        (tmp_path / "codeenc.py").write_text(src.format(tail=tail))
        sys.modules.pop("codeenc", None)
        fps.append(load_encoder("codeenc:build").fingerprint)
    assert fps[0] != fps[1]
    sys.modules.pop("codeenc", None)
    assert load_encoder("codeenc:build").fingerprint == fps[1]


def test_fingerprint_ignores_state_dict_order() -> None:
    sd = TinyConvEncoder().state_dict()
    fwd = state_dict_fingerprint(sd.items(), "x")
    rev = state_dict_fingerprint(reversed(list(sd.items())), "x")
    assert fwd == rev
    assert state_dict_fingerprint(sd.items(), "y") != fwd


def test_fingerprint_does_not_depend_on_threads_and_covers_every_chunk() -> None:
    n = (WEIGHT_CHUNK_BYTES * 2 + 4096) // 4  # three chunks, the last one short
    big = torch.randn(n, generator=torch.Generator().manual_seed(0))
    sd = {"big": big, "small": torch.ones(3, dtype=torch.float16)}
    one = state_dict_fingerprint(sd.items(), "m", threads=1)
    assert state_dict_fingerprint(sd.items(), "m", threads=4) == one
    for idx in (0, WEIGHT_CHUNK_BYTES // 4 + 1, n - 1):  # a byte in each chunk
        changed = big.clone()
        changed[idx] += 1
        assert state_dict_fingerprint({**sd, "big": changed}.items(), "m", threads=4) != one


def test_fingerprint_covers_dtype_shape_and_name() -> None:
    t = torch.zeros(6)
    base = state_dict_fingerprint([("w", t)], "m")
    assert state_dict_fingerprint([("w", t.reshape(2, 3))], "m") != base
    assert state_dict_fingerprint([("w", t.to(torch.float64))], "m") != base
    assert state_dict_fingerprint([("v", t)], "m") != base


def test_fingerprint_of_a_strided_view_equals_its_contiguous_copy() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    assert state_dict_fingerprint([("w", t.t())], "m") == state_dict_fingerprint(
        [("w", t.t().contiguous())], "m"
    )


def test_module_fingerprint_covers_non_persistent_buffers() -> None:
    a, b = TinyConvEncoder(), TinyConvEncoder()
    a.register_buffer("window", torch.ones(4), persistent=False)
    b.register_buffer("window", torch.ones(4) * 2, persistent=False)
    assert module_fingerprint(a, "m") != module_fingerprint(b, "m")


def test_encoder_fingerprint_cache_is_used_and_invalidated(tmp_path: Path, audio_dir: Path) -> None:
    """A rebuild takes the encoder fingerprint from the hash cache; a rewritten file is hashed."""
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt")
    cache = tmp_path / "cache"
    time.sleep(1.1)  # a file changed within the second its hash is cached is hashed again (racy)
    first = build(audio_dir, enc, cache=cache, workers=0)
    cat = Catalog(Layout(cache))
    q = "SELECT sha256 FROM hash_cache WHERE path LIKE 'encoder-fp:%'"
    rows = cat.conn.execute(q).fetchall()
    assert rows == [(first.encoder_fp,)]
    # Poison the cached value: a cache hit must return it verbatim (proves the file was not read).
    cat.conn.execute("UPDATE hash_cache SET sha256=? WHERE path LIKE 'encoder-fp:%'", ("f" * 64,))
    cat.close()
    assert build(audio_dir, enc, cache=cache, workers=0).encoder_fp == "f" * 64
    # Rewriting the file (new weights) changes its stat: the fingerprint is computed again.
    model = TinyConvEncoder(seed=1)
    save_torchscript(model, tmp_path / "enc.tmp")
    os.replace(tmp_path / "enc.tmp", enc)
    third = build(audio_dir, enc, cache=cache, workers=0)
    assert third.encoder_fp not in (first.encoder_fp, "f" * 64)
    assert third.encoded == first.encoded
    assert Recipe().fingerprint() == third.recipe_fp


def _write_pickled_encoder_module(folder: Path, factor: float) -> None:
    (folder / "pk_enc_mod.py").write_text(
        "from featbake.testing import TinyConvEncoder\n\n\n"
        "class PEnc(TinyConvEncoder):\n"
        "    def forward(self, wav):\n"
        f"        return super().forward(wav) * {factor}\n"
    )


def test_a_pickled_encoders_edited_code_is_not_hidden_by_the_fingerprint_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickle's identity includes its class's source: the .pkl's stat cannot vouch for it."""
    data = tmp_path / "audio"
    write_audio_folder(data, 2, seconds=1.0, seed=3)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(pkg))
    _write_pickled_encoder_module(pkg, 1.0)
    import pk_enc_mod

    pkl, cache = tmp_path / "enc.pkl", tmp_path / "cache"
    torch.save(pk_enc_mod.PEnc().eval(), pkl)
    first = build(data, pkl, cache=cache, trust_pickle=True, workers=0)
    assert first.ok and first.encoded == 2
    # The no-load path (CachedFeatureDataset) must not vouch for a pickle by its stat either.
    cat = Catalog(Layout(cache))
    assert cached_file_encoder_fp(cat, pkl) is None
    cat.close()

    _write_pickled_encoder_module(pkg, 3.0)  # edit forward; the .pkl file is untouched
    monkeypatch.delitem(sys.modules, "pk_enc_mod")
    second = build(data, pkl, cache=cache, trust_pickle=True, workers=0)
    assert second.encoder_fp != first.encoder_fp
    assert second.encoded == 2 and second.reused == 0
    enc = load_encoder(pkl, trust_pickle=True)
    layout = Layout(cache)
    cat, reader = Catalog(layout), FeatureReader(layout)
    try:
        for rel, key in cat.root_items(second.root):
            x = source_for(Recipe()).load(data / rel)
            torch.testing.assert_close(reader.get(key)[""], enc.run(x[None])[0])
    finally:
        reader.close()
        cat.close()


class _Scaled(torch.nn.Module):
    """Outputs depend on a plain float attribute, not on code or weights."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=gen))
            self.lin.bias.zero_()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_a_plain_attribute_that_changes_outputs_changes_the_fingerprint(tmp_path: Path) -> None:
    from featbake.encode.encoders import from_module
    from featbake.encode.loaders import load_encoder
    from featbake.testing import save_torchscript

    x = torch.ones(1, 4)
    script_fps, module_fps = set(), set()
    for scale in (1.0, 2.0):
        path = save_torchscript(_Scaled(scale), tmp_path / f"scaled{scale}.pt")
        enc = load_encoder(path)
        assert torch.allclose(enc.run(x), _Scaled(scale).eval()(x))  # outputs really differ
        script_fps.add(enc.fingerprint)
        module_fps.add(from_module(_Scaled(scale)).fingerprint)
    assert len(script_fps) == 2 and len(module_fps) == 2
    # The same module saved under another name keeps its fingerprint (the archive's folder is
    # named after the file; only the pickled attributes' bytes are hashed).
    again = save_torchscript(_Scaled(1.0), tmp_path / "renamed.pt")
    assert load_encoder(again).fingerprint in script_fps


class _MovedGains(torch.nn.Module):
    """A module whose forward moves a dict of tensors it holds to the input's device through a
    dict comprehension, and a list it filters through a list comprehension."""

    def __init__(self) -> None:
        super().__init__()
        self.gains = {"a": torch.tensor(2.0)}
        self.taps = [torch.tensor(1.0), torch.tensor(0.5)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gains = {k: v.to(x.device) for k, v in self.gains.items()}
        self.taps = [t.to(x.device) for t in self.taps if t is not None]
        return x * self.gains["a"] * sum(self.taps)


def test_settings_a_forward_moves_through_a_comprehension_stay_keyed() -> None:
    """Python 3.12 runs a comprehension in the function's own code (PEP 709): its loop's jump
    targets and the stores of its variables end no statement, so ``self.gains = {k: v.to(d)
    for k, v in self.gains.items()}`` reads ``gains`` and keeps it keyed, as on 3.11."""
    module = _MovedGains()
    assert {"gains", "taps"}.isdisjoint(derived_attributes(_MovedGains))
    names = [name for name, _ in tensor_attributes(module)]
    assert names == ["gains.a", "taps.0", "taps.1"]
    before = module_fingerprint(module, "x")
    module.gains["a"] = torch.tensor(3.0)
    assert module_fingerprint(module, "x") != before


def test_what_a_forward_sets_below_an_attribute_is_found_in_every_pythons_bytecode() -> None:
    """``self.monitor.last = out`` loads ``out`` and ``self`` in one op on Python 3.13
    (``LOAD_FAST_LOAD_FAST ('out', 'self')``), where 3.11 and 3.12 load each alone: the walk
    back from the ``STORE_ATTR`` read only the lone load, so on 3.13 the forward's own write
    was missed and a monitor object's tensor changed the key at every run. Both forms, as
    each Python compiles ``self.monitor.last = out`` and ``self.stats[0].mean = out``."""
    from types import SimpleNamespace as Op

    from featbake.keys import _held_below_self

    def op(name: str, arg: object = None) -> Op:
        return Op(opname=name, argval=arg)

    for loads in ([op("LOAD_FAST", "out"), op("LOAD_FAST", "self")],
                  [op("LOAD_FAST_LOAD_FAST", ("out", "self"))]):  # fmt: skip
        monitor = [*loads, op("LOAD_ATTR", "monitor"), op("STORE_ATTR", "last")]
        assert _held_below_self(monitor, len(monitor) - 1) == "monitor"
        stats = [*loads, op("LOAD_ATTR", "stats"), op("LOAD_CONST", 0), op("BINARY_SUBSCR")]
        stats.append(op("STORE_ATTR", "mean"))
        assert _held_below_self(stats, len(stats) - 1) == "stats"
    own = [op("LOAD_FAST_LOAD_FAST", ("out", "self")), op("STORE_ATTR", "last")]
    assert _held_below_self(own, 1) is None  # self.last = out: the module's own attribute
    other = [op("LOAD_FAST_LOAD_FAST", ("self", "cfg")), op("STORE_ATTR", "last")]
    assert _held_below_self(other, 1) is None  # cfg.last = self: not below self


# -- what a file encoder runs besides its forward and its weights ------------------------------
SCRIPTED_HELPERS = """
import sys, torch
from torch import nn

if sys.argv[2] == "relu":
    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)
else:
    def act(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)


class Enc(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, 8, 400, stride=160)

    def helper(self, x: torch.Tensor) -> torch.Tensor:
        return act(x)

    if sys.argv[3] == "method":
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            return self.helper(self.conv(wav.unsqueeze(1))).transpose(1, 2)
    else:
        def forward(self, wav: torch.Tensor) -> torch.Tensor:
            return act(self.conv(wav.unsqueeze(1))).transpose(1, 2)


torch.jit.save(torch.jit.script(Enc().eval()), sys.argv[1])
"""


def _scripted(tmp_path: Path, name: str, act: str, helper: str, seed: int = 1) -> Path:
    """A scripted encoder saved by a process of its own (TorchScript keeps what it compiled
    by name for the process) with string hashing seeded ``seed``: forward calls a ``helper``
    (a method, or a module's function) doing ``act``."""
    maker = tmp_path / "make_scripted.py"
    maker.write_text(SCRIPTED_HELPERS)
    out = tmp_path / name
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    subprocess.run([sys.executable, maker, out, act, helper], check=True, timeout=120, env=env)
    return out


@pytest.mark.parametrize("helper", ["method", "function"])
def test_a_scripted_helper_changed_is_encoded_again_and_served_as_run_now(
    tmp_path: Path, helper: str
) -> None:
    """A TorchScript file whose forward calls a method or a module-level function kept its key
    when only that helper changed (relu to tanh): only forward's own code was keyed, a rebuild
    reused every item and datasets served the relu features for the tanh model. The archive's
    code files are keyed now, each class's declarations in sorted order (their line-number
    tables are not: the same module saved again, by another process, keeps its key)."""
    data, store = tmp_path / "audio", tmp_path / "store"
    write_audio_folder(data, 3, seconds=0.5, seed=5)
    relu = _scripted(tmp_path, "relu.pt", "relu", helper)
    tanh = _scripted(tmp_path, "tanh.pt", "tanh", helper)
    assert load_encoder(relu).module.code == load_encoder(tanh).module.code  # forward alike
    assert _fp(relu) != _fp(tanh)
    # The same module saved by other processes, under another name: one key (torch writes a
    # module's constants in a set's order, which the hash seed changes).
    for seed in (2, 3):
        assert _fp(_scripted(tmp_path, f"again{seed}.pt", "relu", helper, seed)) == _fp(relu)
    ckpt = tmp_path / "ckpt.pt"
    shutil.copy(relu, ckpt)
    assert build(data, ckpt, cache=store, workers=0).encoded == 3
    shutil.copy(tanh, ckpt)
    again = build(data, ckpt, cache=store, workers=0)
    assert (again.encoded, again.reused) == (3, 0)
    layout = Layout(store)
    with Catalog(layout) as cat:
        items = cat.root_items(again.root)
    reader = FeatureReader(layout)
    try:
        for rel, key in items:
            live = torch.jit.load(str(tanh))(source_for(Recipe()).load(data / rel)[None])[0]
            torch.testing.assert_close(reader.get(key)[""], live)
    finally:
        reader.close()


class _Gained(torch.nn.Module):
    """Outputs scaled by a plain tensor attribute (neither a parameter nor a buffer)."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("bias", torch.ones(4))
        self.gain = torch.full((4,), gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain + self.bias


def test_a_scripted_tensor_attribute_changes_the_fingerprint(tmp_path: Path) -> None:
    """A scripted module's plain tensor attribute lives in the archive's storages, which
    ``data.pkl`` only names: files saved with gains 2 and 3 had one key and served each
    other's features. Its value is keyed now, as an eager module's is; a buffer is keyed as a
    buffer, once."""
    x = torch.ones(1, 4)
    fps = set()
    for gain in (2.0, 3.0):
        enc = load_encoder(save_torchscript(_Gained(gain), tmp_path / f"g{gain}.pt"))
        torch.testing.assert_close(enc.run(x), _Gained(gain).eval()(x))
        fps.add(enc.fingerprint)
    assert len(fps) == 2
    loaded = torch.jit.load(str(tmp_path / "g2.0.pt"))
    assert [name for name, _ in tensor_attributes(loaded)] == ["gain"]


class _KeepsLast(torch.nn.Module):
    """A forward that keeps its last output in a tensor attribute (derived state)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.last = torch.zeros(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        self.last = h.detach()
        return h


def test_a_tensor_attribute_a_scripted_forward_writes_is_not_keyed(tmp_path: Path) -> None:
    """What a scripted forward writes (its last output kept, a table grown to the longest
    input) is derived state, as an eager module's is: keyed, it made a new key after every
    forward (a dataset given the module encoded everything again after a validation step)."""
    from featbake.encode.encoders import from_module

    scripted = torch.jit.script(_KeepsLast().eval())
    before = from_module(scripted).fingerprint
    scripted(torch.randn(3, 4))
    assert from_module(scripted).fingerprint == before
    loaded = load_encoder(save_torchscript(_KeepsLast(), tmp_path / "last.pt"))
    assert tensor_attributes(loaded.module) == []


class _Settable(torch.nn.Module):
    """A gain its forward reads and an exported setter writes (forward never calls it)."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.gain = torch.full((4,), gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain

    @torch.jit.export
    def set_gain(self, gain: float) -> None:
        self.gain = torch.full((4,), gain)


class _Scratch(torch.nn.Module):
    """A forward keeping a scratch tensor under a name another submodule keys (``gain``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.zeros(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gain = x.mean(0)
        return x


class _GainThenScratch(torch.nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.a = _Settable(gain)
        self.b = _Scratch()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_only_what_a_scripted_forward_writes_is_left_out_of_its_key(tmp_path: Path) -> None:
    """What a scripted forward writes is derived state; what a method it never calls writes
    (an exported setter) is a setting, and the same name elsewhere in the tree (a scratch
    tensor of another submodule's forward) is another attribute. Leaving out every name any
    method wrote made files of gain 2 and 3 one key, and a module's key the same after
    ``set_gain(3.0)``: the gain-2 features were served for the gain-3 model."""
    from featbake.encode.encoders import from_module

    x = torch.randn(2, 4)
    for make in (_Settable, _GainThenScratch):
        fps = {
            load_encoder(save_torchscript(make(gain), tmp_path / f"{gain}.pt")).fingerprint
            for gain in (2.0, 3.0)
        }
        assert len(fps) == 2, make
    scripted = torch.jit.script(_Settable(2.0).eval())
    before, out = from_module(scripted).fingerprint, scripted(x)
    scripted.set_gain(3.0)
    assert not torch.allclose(scripted(x), out)
    assert from_module(scripted).fingerprint != before
    assert [name for name, _ in tensor_attributes(torch.jit.script(_GainThenScratch(2.0)))] == [
        "a.gain"
    ]


KEYED_ELSEWHERE = """
import sys, torch
from featbake.encode.encoders import from_module

class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x))

mode, before, batch, grad = sys.argv[1:]
x = torch.randn(int(batch), 4, requires_grad=grad == "grad")
if before != "none":  # another Linear compiled first: the process's mangled names move on
    torch.jit.script(torch.nn.Linear(4, 2))
enc = torch.jit.trace(M().eval(), x) if mode == "trace" else torch.jit.script(M().eval())
print(from_module(enc).fingerprint)
"""


@pytest.mark.parametrize("mode", ["script", "trace"])
def test_an_in_process_script_keeps_its_key_whatever_the_process_compiled_before(
    tmp_path: Path, mode: str
) -> None:
    """The graph an in-process TorchScript module is keyed by names types as TorchScript
    numbered them in this process (``___torch_mangle_5``) and, traced, holds the example
    input's shape and grad mode: the same module scripted after another Linear, or traced on
    another batch, made another key, and a process encoded everything again."""
    maker = tmp_path / "keyed.py"
    maker.write_text(KEYED_ELSEWHERE)
    runs = [("none", "2", "nograd"), ("other", "2", "nograd"), ("none", "3", "grad")]
    fps = {
        subprocess.run(
            [sys.executable, maker, mode, *run], capture_output=True, text=True, timeout=120,
            check=True,
        ).stdout.strip()
        for run in runs
    }  # fmt: skip
    assert len(fps) == 1 and len(next(iter(fps))) == 64, fps


class _Branching(torch.nn.Module):
    """A ``torch.cond`` whose taken branch applies ``act``."""

    def __init__(self, act: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 4)
        self.act = torch.relu if act == "relu" else torch.tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cond(h.sum() > -1e9, lambda y: self.act(y), lambda y: y * 2, (h,))


def test_an_exported_programs_branch_changes_the_fingerprint(tmp_path: Path) -> None:
    """A torch.export program's branches (``torch.cond``) live in graphs of their own, which
    the top graph only calls: programs whose taken branch differed (relu, tanh) had one key.
    Every nested graph's code is keyed now."""
    x = torch.randn(2, 3, 4)
    fps = set()
    for act in ("relu", "tanh"):
        path = tmp_path / f"{act}.pt2"
        torch.export.save(torch.export.export(_Branching(act).eval(), (x,)), str(path))
        enc = load_encoder(path)
        torch.testing.assert_close(enc.module(x), _Branching(act).eval()(x))
        fps.add(enc.fingerprint)
    assert len(fps) == 2


def test_a_pickled_modules_helper_in_another_module_changes_the_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pickled module (``--trust-pickle``) whose class calls a helper in another of the
    user's modules kept its key when only the helper changed: only the class's own file was
    keyed. The user's modules it imports are, as an import path's are."""
    pkg = tmp_path / "pkhelp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(
        textwrap.dedent(
            """
            import torch
            from pkhelp import helpers

            class Enc(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    torch.manual_seed(0)
                    self.lin = torch.nn.Linear(4, 4)

                def forward(self, x):
                    return helpers.act(self.lin(x))
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    helper = "import torch\n\ndef act(x):\n    return torch.{}(x)\n"
    (pkg / "helpers.py").write_text(helper.format("relu"))
    from pkhelp import model  # type: ignore[import-not-found]

    pkl = tmp_path / "enc.pkl"
    torch.save(model.Enc().eval(), pkl)
    x = torch.randn(2, 4)
    fps, outs = [], []
    for act in ("relu", "sigmoid"):  # sizes differ: a .pyc of the same size and second stays
        (pkg / "helpers.py").write_text(helper.format(act))
        for name in ("pkhelp.helpers", "pkhelp.model", "pkhelp"):
            sys.modules.pop(name, None)
        enc = load_encoder(pkl, trust_pickle=True)
        fps.append(enc.fingerprint)
        outs.append(enc.module(x))
    assert not torch.equal(outs[0], outs[1]) and fps[0] != fps[1]


def test_an_import_path_returning_a_loaded_script_is_keyed_by_the_functions_it_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A factory returning ``torch.jit.load(path)`` was keyed by its module's repr and its
    weights: files whose forward called a module-level function doing relu or tanh had one
    key. Their graphs, every call inlined, are keyed now (the same program saved by another
    process keeps its key)."""
    (tmp_path / "loads_script.py").write_text(
        "import os, torch\n\ndef build():\n    return torch.jit.load(os.environ['SCRIPTED'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fps = {}
    for act, seed in (("relu", 1), ("relu", 2), ("tanh", 1)):
        path = _scripted(tmp_path, f"{act}{seed}.pt", act, "function", seed)
        monkeypatch.setenv("SCRIPTED", str(path))
        sys.modules.pop("loads_script", None)
        fps[act, seed] = load_encoder("loads_script:build").fingerprint
    assert fps["relu", 1] == fps["relu", 2] != fps["tanh", 1]


def test_an_in_process_script_is_keyed_by_the_functions_it_calls(tmp_path: Path) -> None:
    """A module scripted in the process (``from_module``, ``CachedEncoder``) whose forward
    calls a module-level function was keyed alike doing relu or tanh (each process scripts
    its own: TorchScript keeps what it compiled by name)."""
    maker = tmp_path / "make_scripted.py"
    maker.write_text(SCRIPTED_HELPERS)
    script = (
        "import runpy, sys\n"
        "sys.argv = ['m', sys.argv[1], sys.argv[2], 'function']\n"
        "import torch\n"
        "torch.jit.save = lambda module, path: print(from_module(module).fingerprint)\n"
        "from featbake.encode.encoders import from_module\n"
        f"runpy.run_path({str(maker)!r}, run_name='__main__')\n"
    )
    got = {
        act: subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "x.pt"), act],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout.strip()
        for act in ("relu", "tanh")
    }  # fmt: skip
    assert len(got["relu"]) == 64 and got["relu"] != got["tanh"], got
