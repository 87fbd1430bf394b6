"""CachedEncoder with ``dtype=``: rows stored (in RAM and in shards) as a build stores them,
served dequantised; misses and hits agree; each dtype has its own keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from featbake.errors import ConfigError
from featbake.quantize import Scheme, dequantize, quantize
from featbake.serve.cached_encoder import CachedEncoder
from featbake.store.catalog import Catalog
from featbake.store.features import FeatureReader
from featbake.store.layout import Layout
from featbake.testing import MultiOutputEncoder, TinyConvEncoder, make_tone


def frozen(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


def waves(n: int, seed: int = 0) -> torch.Tensor:
    return torch.stack([torch.from_numpy(make_tone(0.5, seed=seed + i)[:, 0]) for i in range(n)])


def _quantised_now(encoder: nn.Module, x: torch.Tensor, scheme: Scheme, dtype: torch.dtype):
    """The encoder's output now, each row quantised then dequantised (what a hit serves)."""
    with torch.no_grad():
        out = encoder(x)
    return torch.stack([dequantize(quantize(row, scheme), scheme, dtype) for row in out])


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_misses_and_hits_serve_the_output_quantised(tmp_path: Path, dtype: str) -> None:
    scheme = Scheme(dtype)
    enc = frozen(TinyConvEncoder())
    x = waves(4)
    want = _quantised_now(enc, x, scheme, torch.float16)
    cached = CachedEncoder(enc, cache=tmp_path / "c", dtype=dtype)
    first = cached(x)  # every row a miss: encoded, quantised, kept packed
    assert first.dtype == torch.float16 and torch.equal(first, want)
    assert torch.equal(cached(x), want) and cached.cache_info()["hits_ram"] == 4
    cached.flush()
    # A fresh wrapper with no RAM tier reads the rows from the store's shards.
    reader = CachedEncoder(enc, cache=tmp_path / "c", dtype=dtype, ram_cache=0)
    assert torch.equal(reader(x), want) and reader.cache_info()["hits_store"] == 4
    # What the shards hold is the packed form, byte for byte.
    layout = Layout(tmp_path / "c")
    with Catalog(layout) as cat:
        keys = [k for (k,) in cat.conn.execute("SELECT key FROM features").fetchall()]
    stored = FeatureReader(layout).get_many(keys)
    assert {t[""].dtype for t in stored.values()} == {scheme.packed_dtype}
    with torch.no_grad():
        rows = enc(x)
    packed = {quantize(r, scheme).numpy().tobytes() for r in rows}
    assert {t[""].numpy().tobytes() for t in stored.values()} == packed


def test_dtypes_have_their_own_keys_and_the_default_keeps_its_own(tmp_path: Path) -> None:
    enc = frozen(TinyConvEncoder())
    x = waves(2)
    plain = CachedEncoder(enc, cache=tmp_path / "c")
    with torch.no_grad():
        assert torch.equal(plain(x), enc(x))  # unchanged: the encoder's own dtype and keys
    plain.flush()
    int8 = CachedEncoder(enc, cache=tmp_path / "c", dtype="int8", ram_cache=0)
    int8(x)
    assert int8.cache_info()["encoded"] == 2  # not served from the float rows
    half = CachedEncoder(enc, cache=tmp_path / "c", dtype="float16", ram_cache=0)
    with torch.no_grad():
        assert torch.equal(half(x), enc(x).half())


def test_serve_dtype_and_dict_outputs(tmp_path: Path) -> None:
    enc = frozen(MultiOutputEncoder())
    x = waves(3)
    cached = CachedEncoder(enc, cache=tmp_path / "c", dtype="int8", serve_dtype="float32")
    got = cached(x)
    with torch.no_grad():
        out = enc(x)
    for name, value in out.items():
        want = torch.stack(
            [dequantize(quantize(r, Scheme.INT8), Scheme.INT8, torch.float32) for r in value]
        )
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name


def test_bad_dtype_options(tmp_path: Path) -> None:
    enc = frozen(TinyConvEncoder())
    with pytest.raises(ConfigError, match="unsupported stored dtype"):
        CachedEncoder(enc, cache=tmp_path / "c", dtype="int4")
    with pytest.raises(ConfigError, match="serve_dtype applies"):
        CachedEncoder(enc, cache=tmp_path / "c", serve_dtype="float16")
    with pytest.raises(ConfigError, match="apply to int8 and fp8"):
        CachedEncoder(enc, cache=tmp_path / "c", dtype="float16", serve_dtype="float32")
