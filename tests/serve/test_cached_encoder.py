"""CachedEncoder against calling the bare encoder: mixed hits and misses, tiers, standing aside."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

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
from tests.conftest import live_features


def frozen(module: nn.Module) -> nn.Module:
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    return module


class Counting(nn.Module):
    """Counts the rows the wrapped encoder really sees."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.rows = 0

    def forward(self, x: torch.Tensor):
        self.rows += x.shape[0]
        return self.inner(x)


class TupleEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.front = TinyConvEncoder(dim=16, seed=4)

    def forward(self, x: torch.Tensor):
        h = self.front(x)
        return h, h.mean(dim=1)


def waves(n: int, seconds: float = 0.5, seed: int = 0) -> torch.Tensor:
    return torch.stack(
        [torch.from_numpy(make_tone(seconds, seed=seed + i)[:, 0]) for i in range(n)]
    )


def same(a, b) -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and a.keys() == b.keys()
        for k in b:
            same(a[k], b[k])
    elif isinstance(b, tuple):
        assert isinstance(a, tuple) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape
        # Misses run as a smaller batch: allow the kernels' batch-size-dependent rounding.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


#: Rows a wrapper's first call of several misses runs once more: its last row alone, to see
#: that the rows are independent (:func:`refuse_dependent_rows`).
CHECKED = 1


def test_mixed_hits_and_misses_equal_bare_encoder(tmp_path) -> None:
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(6)
    ids = [f"utt{i}" for i in range(6)]
    same(ce(x[:3], ids=ids[:3]), enc.inner(x[:3]))
    assert enc.rows == 3 + CHECKED
    mixed = ce(x[[4, 0, 5, 1]], ids=[ids[4], ids[0], ids[5], ids[1]])
    same(mixed, enc.inner(x[[4, 0, 5, 1]]))
    assert enc.rows == 5 + CHECKED  # only the two new rows were encoded, in one batch
    info = ce.cache_info()
    assert info["hits_ram"] == 2 and info["encoded"] == 5
    ce.flush()
    # A new process (a new wrapper) finds every row in the store and encodes nothing.
    enc2 = frozen(Counting(TinyConvEncoder()))
    ce2 = CachedEncoder(enc2, cache=tmp_path / "store", ram_cache=0)
    same(ce2(x[[0, 1, 4, 5, 2]], ids=[ids[k] for k in (0, 1, 4, 5, 2)]),
         enc2.inner(x[[0, 1, 4, 5, 2]]))  # fmt: skip
    assert enc2.rows == 0 and ce2.cache_info()["hits_store"] == 5


def test_two_wrappers_over_one_store_see_each_others_features_before_any_flush(
    tmp_path,
) -> None:
    """Issue 18 item 4: a second CachedEncoder in the same process encoded again what the
    first had written back, until flush(). Written back in a process = readable in it."""
    x, ids = waves(4), [f"utt{i}" for i in range(4)]
    first = frozen(Counting(TinyConvEncoder()))
    ce1 = CachedEncoder(first, cache=tmp_path / "store", ram_cache=0)
    same(ce1(x[:3], ids=ids[:3]), first.inner(x[:3]))
    second = frozen(Counting(TinyConvEncoder()))
    ce2 = CachedEncoder(second, cache=tmp_path / "store", ram_cache=0)
    same(ce2(x, ids=ids), second.inner(x))
    assert second.rows == 1  # only utt3, which the first never saw
    assert ce2.cache_info()["hits_pending"] == 3
    assert not list((tmp_path / "store" / "shards").rglob("*.safetensors"))  # nothing sealed
    other = CachedEncoder(frozen(Counting(TinyConvEncoder(seed=5))), cache=tmp_path / "store")
    assert other.cache_info()["hits_pending"] == 0
    other(x[:1], ids=ids[:1])  # another encoder: its keys differ, nothing is shared
    assert other.cache_info()["encoded"] == 1


def test_two_datasets_in_one_process_share_what_one_wrote_back(
    audio_dir, encoder_file, tmp_path
) -> None:
    from featbake.serve.dataset import CachedFeatureDataset

    store = tmp_path / "store"
    with pytest.warns(UserWarning, match="no featbake store"):
        a = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    b = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    got = a[2]
    assert a.cache_info().encoded == 1
    same(b[2], got)
    assert b.cache_info().encoded == 0  # read from a's pending write-back, not encoded again
    same(got, live_features(encoder_file, Path(a.path(2))))


def test_keys_from_row_bytes_without_ids(tmp_path) -> None:
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(4)
    ce(x)
    y = x.clone()
    y[2, 100] += 0.25  # one changed sample: that row is a new input
    same(ce(y), enc.inner(y))
    assert enc.rows == 5 + CHECKED


def test_dict_and_tuple_outputs(tmp_path) -> None:
    for module in (MultiOutputEncoder(), TupleEncoder()):
        enc = frozen(module)
        ce = CachedEncoder(enc, cache=tmp_path / type(module).__name__)
        x = waves(5, seed=10)
        ce(x[:2])
        same(ce(x), enc(x))
        ce.flush()
        fresh = CachedEncoder(enc, cache=tmp_path / type(module).__name__, ram_cache=0)
        same(fresh(x[:2]), enc(x[:2]))
        assert fresh.cache_info()["hits_store"] == 2


def test_trainable_encoder_runs_untouched_and_warns_once(tmp_path) -> None:
    enc = Counting(TinyConvEncoder())  # requires grad, training mode
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(3)
    with pytest.warns(UserWarning, match="uncached"):
        out = ce(x)
    assert out.requires_grad  # the gradient still flows: nothing was served from a cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ce(x)  # warned once only
    assert enc.rows == 6 and ce.cache_info()["encoded"] == 0
    assert not list((tmp_path / "store" / "shards").rglob("*.safetensors"))
    frozen(enc)
    ce(x)
    assert ce.cache_info()["encoded"] == 3  # active as soon as it is frozen


def test_the_warning_names_all_that_keeps_caching_off_and_speaks_again_until_on(
    tmp_path,
) -> None:
    """Issue 18 item 3: the warning said "call .eval()"; after .eval() the parameters still
    required grad, caching stayed off, and nothing more was said."""
    enc = Counting(TinyConvEncoder())  # training mode, parameters require grad
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(2)
    with pytest.warns(UserWarning) as first:
        ce(x)
    (msg,) = [str(w.message) for w in first]
    assert ".eval()" in msg and "requires_grad_(False)" in msg  # both, in one message
    enc.eval()
    with pytest.warns(UserWarning) as second:
        ce(x)
    (msg,) = [str(w.message) for w in second]
    assert "requires_grad_(False)" in msg and "training mode" not in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ce(x)  # the same state: said once
        enc.requires_grad_(False)
        out = ce(x)  # on now: nothing to say
    assert ce.cache_info()["encoded"] == 2
    torch.testing.assert_close(out, enc(x))


def test_disabled_and_eval_mode_checks(tmp_path) -> None:
    enc = frozen(Counting(TinyConvEncoder()))
    off = CachedEncoder(enc, store=False, enabled=False)
    x = waves(2)
    with pytest.warns(UserWarning, match="enabled=False"):
        off(x)
    off(x)
    assert enc.rows == 4
    on = CachedEncoder(enc, store=False)
    enc.train()
    with pytest.warns(UserWarning, match="training mode"):
        on(x)
    assert not on.active()


def test_weights_changed_in_place_are_never_served_stale(tmp_path) -> None:
    enc = frozen(TinyConvEncoder())
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(2)
    before = ce(x, ids=["a", "b"])
    fp = ce.fingerprint()
    with torch.no_grad():
        enc.conv2.weight.mul_(2.0)  # e.g. load_state_dict of a new checkpoint
    after = ce(x, ids=["a", "b"])
    assert ce.fingerprint() != fp
    same(after, enc(x))
    assert not torch.equal(before, after)


def test_ids_must_match_rows(tmp_path) -> None:
    ce = CachedEncoder(frozen(TinyConvEncoder()), store=False)
    with pytest.raises(ConfigError, match="2 ids for a batch of 3"):
        ce(waves(3), ids=["a", "b"])


def test_ram_only_budget_and_module_behaviour(tmp_path) -> None:
    enc = frozen(TinyConvEncoder())
    ce = CachedEncoder(enc, store=False, ram_cache=40_000)
    for start in range(0, 12, 3):
        x = waves(3, seed=start)
        same(ce(x), enc(x))
        assert ce.cache_info()["ram"].bytes <= 40_000
    assert ce.cache_info()["ram"].evictions > 0
    assert "encoder.conv1.weight" in ce.state_dict()  # still a normal module around the encoder


def test_edited_encoder_code_is_never_served_from_the_old_cache(tmp_path, monkeypatch) -> None:
    """The key covers the wrapped encoder's source, as for from_module: a new forward re-encodes."""
    import importlib
    import sys

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    monkeypatch.syspath_prepend(str(pkg))
    x = waves(3)
    for factor in (1.0, 3.0):
        (pkg / "ce_enc_mod.py").write_text(
            "from featbake.testing import TinyConvEncoder\n\n\n"
            "class Scaled(TinyConvEncoder):\n"
            "    def forward(self, wav):\n"
            f"        return super().forward(wav) * {factor}\n"
        )
        sys.modules.pop("ce_enc_mod", None)
        mod = importlib.import_module("ce_enc_mod")
        bare = frozen(mod.Scaled())
        ce = CachedEncoder(bare, cache=tmp_path / "store", ram_cache=0)
        out = ce(x)
        ce.flush()
        assert ce.stats["encoded"] == 3 and ce.stats["hits_store"] == 0
        with torch.no_grad():
            same(out, bare(x))
    sys.modules.pop("ce_enc_mod", None)


@pytest.mark.parametrize("store", [True, False])
def test_a_dropped_cached_encoder_is_collected_with_its_model(tmp_path, store) -> None:
    """Nothing global keeps the wrapper (and so the model and its tiers) alive once dropped."""
    import gc
    import weakref

    model = frozen(TinyConvEncoder())
    ce = CachedEncoder(model, cache=tmp_path / "s" if store else None, store=store)
    ce(waves(2))
    refs = (weakref.ref(ce), weakref.ref(model))
    del ce, model
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_gc_keeps_what_cached_encoder_stored_until_its_root_is_dropped(tmp_path) -> None:
    from featbake.upkeep import GcOptions, drop_root, execute_gc, list_roots, plan_gc

    store = tmp_path / "store"
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=store)
    x = waves(4)
    ids = [f"utt{i}" for i in range(4)]
    ce(x, ids=ids)
    ce.flush()
    roots = [r for r in list_roots(store) if r.data.startswith("cached-encoder:")]
    assert len(roots) == 1 and roots[0].items == 4 and roots[0].missing == 0

    execute_gc(plan_gc(store, GcOptions(grace=0)))
    enc2 = frozen(Counting(TinyConvEncoder()))
    ce2 = CachedEncoder(enc2, cache=store, ram_cache=0)
    same(ce2(x, ids=ids), enc2.inner(x))
    assert enc2.rows == 0, "gc deleted features a CachedEncoder had stored"

    drop_root(store, roots[0].name)
    result = execute_gc(plan_gc(store, GcOptions(grace=0)))
    assert result.rows_deleted == 4


def test_long_tensor_ids_are_keyed_by_their_bytes(tmp_path) -> None:
    """str() of a 2,000-element tensor abbreviates it: two ids differing in one element in the
    middle must still get their own features."""
    enc = frozen(TinyConvEncoder())
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    a = torch.arange(2000)
    b = a.clone()
    b[1000] = -1
    assert str(a) == str(b)  # what the keys used to be made of
    x = waves(2)
    same(ce(x[:1], ids=[a]), enc(x[:1]))
    same(ce(x[1:], ids=[b]), enc(x[1:]))
    same(ce(x, ids=[a, b]), enc(x))
    assert ce.stats["encoded"] == 2
    same(ce(x[:1], ids=[(1, "a")]), enc(x[:1]))  # tuples, numbers and strings are ids too
    with pytest.raises(ConfigError, match="ids must be"):
        ce(x[:1], ids=[object()])


def test_weights_updated_through_data_are_never_served_stale(tmp_path) -> None:
    """An EMA teacher updated with p.data.mul_(), which bypasses the version counters."""
    enc = frozen(TinyConvEncoder())
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(2)
    before = ce(x, ids=["a", "b"])
    same(before, enc(x))
    for p in enc.parameters():
        p.data.mul_(0.5)
    after = ce(x, ids=["a", "b"])
    same(after, enc(x))
    assert not torch.allclose(before, after)
    ce.flush()
    fresh = CachedEncoder(enc, cache=tmp_path / "store", ram_cache=0)
    same(fresh(x, ids=["a", "b"]), enc(x))


class Scaled(nn.Module):
    """Uses a plain attribute in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyConvEncoder(dim=16, seed=5)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def test_attribute_changed_after_wrapping_is_never_served_stale(tmp_path) -> None:
    enc = frozen(Scaled())
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(2)
    before = ce(x, ids=["a", "b"])
    enc.scale = 3.0
    after = ce(x, ids=["a", "b"])
    same(after, enc(x))
    torch.testing.assert_close(after, before * 3.0, rtol=1e-5, atol=1e-5)


def test_counters_the_encoder_keeps_do_not_defeat_the_cache(tmp_path) -> None:
    """Attributes the module changes itself while running (a call counter) are bookkeeping."""
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(3)
    for _ in range(3):
        same(ce(x, ids=["a", "b", "c"]), enc.inner(x))
    assert enc.rows == 3 + CHECKED and ce.stats["encoded"] == 3


def test_a_shard_deleted_by_hand_is_encoded_again(tmp_path) -> None:
    enc = frozen(TinyConvEncoder())
    store = tmp_path / "store"
    ce = CachedEncoder(enc, cache=store)
    x = waves(4)
    ce(x[:2], ids=["a", "b"])
    ce.flush()
    (lost,) = list(store.rglob("*.safetensors"))
    ce(x[2:], ids=["c", "d"])
    ce.flush()
    lost.unlink()
    fresh = CachedEncoder(enc, cache=store, ram_cache=0)
    same(fresh(x, ids=["a", "b", "c", "d"]), enc(x))
    assert fresh.stats["hits_store"] == 2 and fresh.stats["encoded"] == 2


def test_a_forked_child_seals_only_its_own_write_back(tmp_path) -> None:
    """A child forked while the parent has features pending neither seals nor loses them: the
    parent seals its own, the child seals what it encoded."""
    import os

    from featbake.store.shard import ShardReader

    enc = frozen(TinyConvEncoder())
    store = tmp_path / "store"
    ce = CachedEncoder(enc, cache=store)
    x = waves(2)
    ce(x[:1], ids=["parent"])  # pending in the parent
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            torch.set_num_threads(1)  # as DataLoader workers do: OpenMP's pool is not fork-safe
            ce(x[1:], ids=["child"])
            ce.flush()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    (child_shard,) = list(store.rglob("*.safetensors"))
    with ShardReader(child_shard) as r:
        assert len(r.tensors) == 1  # the child's row only, not the parent's pending one
    ce.flush()
    assert len(list(store.rglob("*.safetensors"))) == 2
    fresh = CachedEncoder(enc, cache=store, ram_cache=0)
    same(fresh(x, ids=["parent", "child"]), enc(x))
    assert fresh.stats["hits_store"] == 2


def test_numpy_ids_are_keyed_like_tensor_ids(tmp_path) -> None:
    """Issue 16 item 10: an id array (``ids=np.array([3, 4])``) and numpy scalar ids are keyed
    by dtype and bytes, as a tensor of ids is, and what is still refused is named truly."""
    np = pytest.importorskip("numpy")
    enc = frozen(TinyConvEncoder())
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    x = waves(2)
    same(ce(x, ids=np.array([3, 4])), enc(x))
    assert ce.stats["encoded"] == 2
    same(ce(x, ids=[np.int64(3), np.int64(4)]), enc(x))  # the array's elements: the same keys
    same(ce(x[:1], ids=(np.float32(3.0),)), enc(x[:1]))  # another dtype: another key
    assert ce.stats["encoded"] == 3
    ce.flush()
    fresh = CachedEncoder(frozen(TinyConvEncoder()), cache=tmp_path / "store")
    same(fresh(x[[1, 0]], ids=np.array([4, 3])), enc(x[[1, 0]]))  # from the store
    assert fresh.stats["encoded"] == 0 and fresh.stats["hits_store"] == 2
    with pytest.raises(ConfigError, match=r"type builtins\.dict") as refused:
        ce(x[:1], ids=[{"utt": 1}])
    assert "int64" not in str(refused.value)
    with pytest.raises(ConfigError, match="dtype object"):
        ce(x[:1], ids=[np.array([object()], dtype=object)])  # one row, its id an array


def test_on_a_shared_filesystem_it_writes_fragments_never_the_catalog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27: CachedEncoder consulted no serving mode, so on NFS/Lustre it wrote
    catalog.sqlite from every host. It now writes fragments as a dataset does; a merge folds
    them, and a second encoder then serves every row from the store."""
    import sqlite3

    from featbake.store.layout import Layout
    from featbake.store.merge import merge
    from featbake.upkeep import list_roots

    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    store = tmp_path / "store"
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=store)
    x = waves(4)
    ids = [f"utt{i}" for i in range(4)]
    same(ce(x, ids=ids), enc.inner(x))
    ce.flush()
    if (store / "catalog.sqlite").exists():  # only the read-only opening may have made it
        with sqlite3.connect(store / "catalog.sqlite") as conn:
            assert conn.execute("SELECT count(*) FROM features").fetchone() == (0,)
    assert list((store / "fragments").glob("*.serve.sqlite"))  # recorded for the merge
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "0")
    merge(Layout(store))
    roots = [r for r in list_roots(store) if r.data.startswith("cached-encoder:")]
    assert len(roots) == 1 and roots[0].items == 4
    enc2 = frozen(Counting(TinyConvEncoder()))
    ce2 = CachedEncoder(enc2, cache=store, ram_cache=0)
    same(ce2(x, ids=ids), enc2.inner(x))
    assert enc2.rows == 0, "the merged fragments did not serve"


# == test_cached_encoder_dtypes ====================================================================
# CachedEncoder with ``dtype=``: rows stored (in RAM and in shards) as a build stores them,
# served dequantised; misses and hits agree; each dtype has its own keys.


def dtype_waves(n: int, seed: int = 0) -> torch.Tensor:
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
    x = dtype_waves(4)
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
    x = dtype_waves(2)
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
    x = dtype_waves(3)
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


def test_an_empty_batch_gives_what_the_encoder_gives_for_none(tmp_path: Path) -> None:
    """A batch of no rows (a filtered batch that kept none) ended in ``IndexError: list index
    out of range`` from the wrapper; it is the encoder's own empty output now, for a tensor
    output and a dict one, with ids and without, and the wrapper serves rows after it."""
    for module in (TinyConvEncoder(), MultiOutputEncoder()):
        enc = frozen(module)
        wrapped = CachedEncoder(enc, cache=tmp_path / type(module).__name__)
        none = torch.zeros(0, 8000)
        for ids in (None, []):
            got, want = wrapped(none, ids=ids), enc(none)
            if isinstance(want, dict):
                assert got.keys() == want.keys()
                for name in want:
                    assert got[name].shape == want[name].shape
            else:
                assert got.shape == want.shape == (0, 48, 64)
        x = torch.randn(2, 8000)
        out, bare = wrapped(x), enc(x)
        first = out["hidden"] if isinstance(out, dict) else out
        torch.testing.assert_close(first, bare["hidden"] if isinstance(bare, dict) else bare)


def test_a_module_made_under_inference_mode_is_cached_and_watched(tmp_path: Path) -> None:
    """A teacher built or loaded under ``torch.inference_mode()`` has inference tensors for
    weights, which keep no version counter: every call ended in ``RuntimeError: Inference
    tensors do not track version counter.`` It is cached now, and an in-place update of its
    weights (under inference mode, where one may edit them) is still noticed by the weight
    probe, so the new weights' outputs are served."""
    with torch.inference_mode():
        enc = frozen(TinyConvEncoder())
    wrapped = CachedEncoder(enc, cache=tmp_path / "s")
    x = torch.randn(2, 8000)
    torch.testing.assert_close(wrapped(x), enc(x))
    torch.testing.assert_close(wrapped(x), enc(x))
    assert wrapped.stats["encoded"] == 2  # the second call was served from the cache
    with torch.inference_mode():
        enc.conv2.weight.mul_(2.0)
    torch.testing.assert_close(wrapped(x), enc(x))
    assert wrapped.stats["encoded"] == 4


def test_a_callers_in_place_edit_of_its_output_is_served_by_no_later_call(
    tmp_path: Path,
) -> None:
    """Every tier on the CPU (RAM, the pending write-back, the store) hands the caller a batch
    of its own: zeroed in place by the caller, a later call still equals the encoder run now.
    (The device tier, kept only on a GPU, kept slices of the caller's batch: see
    ``tests/test_cuda.py``.)"""
    enc = frozen(TinyConvEncoder())
    x, ids = waves(3), ["a", "b", "c"]
    want = enc(x)
    for ram in ("1MiB", 0):
        cached = CachedEncoder(enc, cache=tmp_path / f"s{ram}", ram_cache=ram)
        for _ in range(2):  # a miss, then a hit from RAM or the pending write-back
            cached(x, ids=ids).zero_()
            same(cached(x, ids=ids), want)
        cached.flush()
        again = CachedEncoder(enc, cache=tmp_path / f"s{ram}", ram_cache=ram)
        again(x, ids=ids).zero_()  # read from the store
        same(again(x, ids=ids), want)
        assert again.stats["encoded"] == 0 and again.stats["hits_store"] >= 3


def test_a_moved_tensor_is_read_in_the_kind_of_its_trusted_probe_entry() -> None:
    """serve9.1's comparison by value: a tensor trusted on the CPU (a CRC-32C) and one trusted
    on a device (a byte sum and a place-weighted one) are each read in that kind wherever they
    are now, so a move to or from a device compares values, not probes of two kinds; a tensor
    on the meta device matches nothing. Rows permuted keep the byte sum, not the device
    entry."""
    from featbake.serve.cached_encoder import device_entry, value_entry
    from featbake.store.shard import crc32c_tensor

    t = torch.randn(64)
    crc = crc32c_tensor(t)
    assert value_entry(t.clone(), crc) == crc
    assert value_entry(t * 2, crc) != crc
    b = t.view(torch.uint8)
    entry = device_entry(t)
    assert entry[0] == int(b.sum(dtype=torch.int64))
    assert value_entry(t.clone(), (0, 0)) == entry
    swapped = t.view(8, 8)[[1, 0, 2, 3, 4, 5, 6, 7]].reshape(-1)
    assert device_entry(swapped)[0] == entry[0] and device_entry(swapped) != entry
    assert value_entry(t.to("meta"), crc) is None
    assert value_entry(torch.empty(0), crc) == 0


def _scaled(module: nn.Module, args: tuple[torch.Tensor, ...], factor: float) -> tuple:
    return (args[0] * factor,)


def test_a_module_whose_hook_was_replaced_by_one_of_the_same_name_is_served_as_it_runs_now() -> (
    None
):
    """serve9.5 kept the fingerprint of a module whose hook was replaced by a partial with
    other arguments (the same qualified name and file), and served its RAM hits encoded with
    the old hook: the hook objects are compared, and a partial's arguments keyed."""
    import functools

    module = frozen(TinyConvEncoder())
    handle = module.register_forward_pre_hook(functools.partial(_scaled, factor=2.0))
    cached = CachedEncoder(module, cache=None)
    x = torch.randn(2, 8000, generator=torch.Generator().manual_seed(0))
    cached(x, ids=["a", "b"])
    handle.remove()
    module.register_forward_pre_hook(functools.partial(_scaled, factor=3.0))
    with torch.no_grad():
        now = module(x)
    torch.testing.assert_close(cached(x, ids=["a", "b"]), now)


def test_a_wrapped_module_moved_to_meta_is_refused_in_one_line(tmp_path: Path) -> None:
    """A wrapped module moved to the meta device failed with torch's traceback (``Cannot
    copy out of meta tensor``) at the next call: refused in one line naming the tensor."""
    from featbake.errors import EncoderLoadError

    module = frozen(TinyConvEncoder())
    cached = CachedEncoder(module, cache=tmp_path / "s")
    x = torch.randn(2, 8000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cached(x, ids=["a", "b"]), module(x))
    module.to("meta")
    with pytest.raises(EncoderLoadError, match=r"meta device \(conv1.weight\)") as e:
        cached(x, ids=["a", "b"])
    assert "\n" not in str(e.value)


def test_a_pickled_watch_of_a_module_with_a_tensor_attribute_keeps_its_fingerprint() -> None:
    """A watch pickled (a ``CachedEncoder`` sent to a worker) carried its trusted reading of
    what no key reads (tensor attributes: ids of the process it left), so where it landed the
    module read as changed and was keyed apart: taken again where it lands."""
    import pickle

    from featbake.serve.cached_encoder import ModuleWatch

    module = frozen(TinyConvEncoder())
    module.scale = torch.tensor(1.0)
    watch = ModuleWatch(module)
    fp = watch.fingerprint()
    copy = pickle.loads(pickle.dumps(watch))
    assert copy.fingerprint() == fp and copy.unkeyed_change == ""


def test_a_module_whose_hook_holds_a_tensor_is_refused_at_its_first_call() -> None:
    """A partial's tensor argument was keyed by its type alone: edited in place, the RAM hits
    and stored features of the old value were served. Refused in one line at the first call."""
    import functools

    from featbake.errors import EncoderLoadError

    module = frozen(TinyConvEncoder())
    module.register_forward_pre_hook(functools.partial(_scaled, factor=torch.tensor(2.0)))
    cached = CachedEncoder(module, cache=None)
    x = torch.randn(2, 8000, generator=torch.Generator().manual_seed(0))
    with pytest.raises(EncoderLoadError, match=r"holds factor \(Tensor\)") as e:
        cached(x, ids=["a", "b"])
    assert "\n" not in str(e.value)


# == round ten: a hook's held dict edited in place (serve10.1) ==================================
def _dict_scaled(config: dict[str, float]) -> Any:
    """A pre-hook scaling its input by ``config["factor"]``, read at each call."""

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * config["factor"],)

    return hook


def test_a_hooks_dict_edited_in_place_is_not_served_stale_by_cached_encoder() -> None:
    """A dict a hook closes over, edited in place, was seen by no watch (keyed by its type):
    the RAM hits encoded with the old factor were served (fails on the code before)."""
    module = TinyConvEncoder().eval()
    for p in module.parameters():
        p.requires_grad_(False)
    config = {"factor": 2.0}
    module.register_forward_pre_hook(_dict_scaled(config))
    cached = CachedEncoder(module, cache=None)
    x = torch.randn(2, 8000, generator=torch.Generator().manual_seed(0))
    cached(x, ids=["a", "b"])
    config["factor"] = 3.0
    with torch.no_grad():
        now = module(x)
    torch.testing.assert_close(cached(x, ids=["a", "b"]), now)


# == finalizers the collector runs at an arbitrary point ===========================================
def dropped_with_pending_write_back(enc: nn.Module, store: Path, x: torch.Tensor) -> list[str]:
    """A CachedEncoder that encoded ``x`` (its write-back pending, not sealed: it is younger than
    WRITEBACK_SECONDS) and was then dropped inside a reference cycle, so only the cyclic
    collector runs its write-back finalizer; the ids it encoded."""
    ids = [f"dropped-{i}" for i in range(x.shape[0])]
    dropped = CachedEncoder(enc, cache=store)
    dropped(x, ids=ids)
    dropped.cycle = [dropped]  # type: ignore[assignment]
    return ids


def test_a_write_back_collected_inside_another_writers_transaction_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two CachedEncoders over one store; one is dropped in a cycle. The collector runs its
    finalizer (seal and commit its pending shard) at any allocation: here, inside the other's
    seal, in ``Catalog.add_shard``'s BEGIN IMMEDIATE transaction. The finalizer's commit needs
    the write lock its own thread holds: it waits the whole busy timeout, then its features are
    dropped (a warning) and encoded again by the next run. The timeout is shortened to keep the
    test quick; the wait on itself is the same at any length."""
    import gc

    import featbake.store.catalog as catalog_module

    monkeypatch.setitem(catalog_module.Catalog.__init__.__kwdefaults__, "timeout", 0.5)
    enc = frozen(TinyConvEncoder())
    store = tmp_path / "store"
    x = torch.stack([torch.from_numpy(make_tone(0.4, seed=s)[:, 0]) for s in range(3)])
    live = CachedEncoder(enc, cache=store)
    live(x[:1], ids=["live"])  # pending in the live wrapper's write-back
    real_holds_shard = catalog_module.holds_shard
    collected: list[bool] = []

    def collect_inside_the_transaction(layout: Layout, name: str) -> bool:
        if not collected:  # the first check runs inside live's BEGIN IMMEDIATE
            collected.append(True)
            gc.collect()  # what any allocation here may do
        return real_holds_shard(layout, name)

    gc.disable()
    try:
        ids = dropped_with_pending_write_back(enc, store, x[1:])
        monkeypatch.setattr(catalog_module, "holds_shard", collect_inside_the_transaction)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            live.flush()
    finally:
        gc.enable()
    monkeypatch.undo()
    assert collected
    fresh = CachedEncoder(enc, cache=store, ram_cache=0)
    torch.testing.assert_close(fresh(x[1:], ids=ids), enc(x[1:]), rtol=1e-5, atol=1e-6)
    assert fresh.cache_info()["hits_store"] == len(ids), [str(w.message) for w in caught]


def test_a_watch_collected_while_another_reads_the_hooks_does_not_fail_a_forward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module with a hook of the user's own, a CachedEncoder over it, and a dataset's shared
    watch of it (following runs: two hooks of its own) dropped inside a reference cycle. The
    collector runs the dropped watch's finalizers (``handle.remove``) at any allocation: here,
    while the CachedEncoder's watch reads the user's hook (``held_values``) inside its loop over
    ``module._forward_hooks``. The dict shrinks under that loop, and the forward raises
    ``RuntimeError: OrderedDict mutated during iteration`` instead of returning features."""
    import gc

    import featbake.serve.cached_encoder as cached_encoder_module

    module = frozen(TinyConvEncoder())
    module.register_forward_hook(lambda m, i, o: o * 1.0)  # the user's own hook
    x = torch.stack([torch.from_numpy(make_tone(0.4, seed=s)[:, 0]) for s in range(2)])
    live = CachedEncoder(module, cache=tmp_path / "store")
    live(x, ids=["a", "b"])
    real_held_values, collected = cached_encoder_module.held_values, []

    def collect_inside_the_loop(hook: Any) -> Any:
        if not collected:
            collected.append(True)
            gc.collect()  # what any allocation in the loop may do
        return real_held_values(hook)

    gc.disable()
    try:
        cycle: list[Any] = [cached_encoder_module.shared_watch(module)]
        cycle.append(cycle)
        del cycle
        monkeypatch.setattr(cached_encoder_module, "held_values", collect_inside_the_loop)
        got = live(x, ids=["a", "b"])
    finally:
        gc.enable()
    assert collected
    with torch.no_grad():
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-6)


class EncodedRows(torch.utils.data.Dataset):
    """Each item encoded through a CachedEncoder, inside whichever process reads it."""

    def __init__(self, cached: CachedEncoder, x: torch.Tensor) -> None:
        self.cached, self.x = cached, x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.cached(self.x[i : i + 1], ids=[f"row-{i}"])[0]


def test_a_cached_encoder_used_in_a_dataloader_worker_keeps_its_write_back(
    tmp_path: Path,
) -> None:
    """A dataset's write-back is sealed in a worker by a multiprocessing Finalize, which the
    worker runs as its loop ends; a CachedEncoder's by ``weakref.finalize``, whose exit hook is
    ``atexit``'s, which a forked worker skips. Features encoded in the worker and not yet due
    (the clock here never ages them; with the real one, the last 5 s of them) are never sealed:
    the next run encodes them again."""
    enc = frozen(TinyConvEncoder())
    x = torch.stack([torch.from_numpy(make_tone(0.4, seed=s)[:, 0]) for s in range(3)])
    cached = CachedEncoder(enc, cache=tmp_path / "store", clock=lambda: 1000.0)
    loader = torch.utils.data.DataLoader(
        EncodedRows(cached, x), batch_size=None, num_workers=1, multiprocessing_context="fork"
    )
    assert len(list(loader)) == 3  # the worker has ended: its loop is over
    fresh = CachedEncoder(enc, cache=tmp_path / "store", ram_cache=0)
    fresh(x, ids=[f"row-{i}" for i in range(3)])
    assert fresh.cache_info()["hits_store"] == 3


# == round nineteen: calls CachedEncoder cannot key, and states it must not cache ================
class Masked(nn.Module):
    """A linear encoder that takes an optional mask, zeroing masked-out features."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.lin(x)
        return y if mask is None else y * mask[:, None]


def test_an_argument_beside_the_batch_is_refused_never_taken_as_ids(tmp_path: Path) -> None:
    """``ce(x, mask)`` filled ``ids`` with the mask: the encoder ran without it, and another
    batch with the same mask was served the first batch's rows. Only ``x`` and ``ids=`` are
    taken; the rest, one string as ids and an input that is not a tensor are one line each."""
    enc = frozen(Masked())
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    x, mask = torch.randn(3, 8), torch.tensor([1.0, 0.0, 1.0])
    for call in (lambda: ce(x, mask), lambda: ce(x, mask=mask), lambda: ce(x, ["a", "b", "c"])):
        with pytest.raises(ConfigError, match="one input batch to the encoder"):
            call()
    with pytest.raises(ConfigError, match="one id per character"):
        ce(x, ids="utt")
    with pytest.raises(ConfigError, match="takes one tensor batch"):
        ce({"input": x})  # type: ignore[arg-type]
    assert ce.stats["encoded"] == 0
    same(ce(x, ids=["a", "b", "c"]), enc(x))


def test_rows_encoded_under_autocast_are_keyed_apart_from_plain_ones(tmp_path: Path) -> None:
    """Ambient autocast was not in the keys: rows cached inside ``torch.autocast`` were served
    to plain calls (bfloat16, off by 5e-3) and plain rows inside autocast. Each call's rows
    now equal the encoder run now, in the same mode, across a new wrapper's store reads."""
    enc = frozen(nn.Linear(64, 64))
    x = torch.randn(4, 64)
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = ce(x[:2])
        assert first.dtype == torch.bfloat16
    plain = ce(x)  # two rows cached in bfloat16, two new: all four float32, as the encoder's
    same(plain, enc(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same(ce(x), enc(x))
    ce.flush()
    again = CachedEncoder(enc, cache=tmp_path / "s", ram_cache=0)
    same(again(x), enc(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same(again(x), enc(x))
    assert again.stats["encoded"] == 0  # both modes found in the store


def test_a_submodule_in_train_mode_or_a_trainable_held_tensor_stands_it_aside(
    tmp_path: Path,
) -> None:
    """Only the top module's ``.training`` and its parameters were read: a dropout submodule
    left in train mode had one random draw cached and served for ever, and a learned prompt
    kept as a plain tensor lost its gradient (rows served detached). Both run uncached now,
    with the warning naming what to change."""
    net = frozen(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)))
    net[1].train()
    ce = CachedEncoder(net, cache=tmp_path / "s")
    x = torch.randn(64, 8)
    with pytest.warns(UserWarning, match="'1' has .training set"):
        a = ce(x)
    b = ce(x)
    assert not torch.equal(a, b) and ce.stats["encoded"] == 0  # the encoder's own draws

    class Prompted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.prompt = torch.zeros(8, requires_grad=True)  # trained, not a parameter

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x + self.prompt)

    prompted = frozen(Prompted())
    ce = CachedEncoder(prompted, cache=tmp_path / "p")
    with pytest.warns(UserWarning, match=r"require grad \(prompt\)"):
        out = ce(x)
    out.sum().backward()
    assert prompted.prompt.grad is not None and ce.stats["encoded"] == 0


def test_an_id_padded_to_another_length_is_another_input(tmp_path: Path) -> None:
    """An id is keyed with its row's dtype and shape: a clip padded to each batch's longest,
    as a shuffled loop pads it, was served the features of the length it was first padded to
    where every row of a later call carried it (``(1, 73, 64)`` for a clip now ``(1, 48,
    64)``), and stacking such a row with a new one of another length failed in torch. Each
    length is encoded once and served as the encoder gives it now."""
    enc = frozen(Counting(TinyConvEncoder()))
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    clips = [waves(1, seconds, seed=i)[0] for i, seconds in enumerate((0.5, 0.75))]

    def padded(rows: list[int]) -> torch.Tensor:
        x = torch.zeros(len(rows), max(clips[r].numel() for r in rows))
        for i, r in enumerate(rows):
            x[i, : clips[r].numel()] = clips[r]
        return x

    for rows in ([0, 1], [0], [1, 0], [0]):
        x = padded(rows)
        same(ce(x, ids=[f"u{r}" for r in rows]), enc.inner(x))
    assert ce.stats["encoded"] == 3  # u0 and u1 at 0.75 s, u0 alone at 0.5 s


def test_a_conjugate_view_is_keyed_by_its_values_and_odd_output_keys_are_refused(
    tmp_path: Path,
) -> None:
    """A lazy conjugate view (``z.conj()``) could not be keyed: ``torch.Tensor.view is not
    supported for conjugate view tensors``; it is keyed by its values now. A dict output
    keyed by a number came back keyed by a string, and ``{1: a, "1": b}`` lost one part: both
    are refused in one line."""
    from featbake.errors import EncodeError

    class Magnitude(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.view_as_real(z.resolve_conj()).flatten(1))

    enc = frozen(Magnitude())
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    z = torch.randn(2, 4, dtype=torch.complex64)
    same(ce(z), enc(z))
    same(ce(z.conj()), enc(z.conj()))  # other values: another key, not z's rows
    assert ce.stats["encoded"] == 4

    class NumberKeys(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[Any, torch.Tensor]:
            return {1: x * 2, "1": x * 3}

    with pytest.raises(EncodeError, match=r"key 1 \(int\)"):
        CachedEncoder(NumberKeys().eval(), cache=tmp_path / "k")(torch.randn(2, 3))


class _Off(nn.Module):
    """TinyConvEncoder's output as NaN (``nan``) or times 1e6 (``huge``: finite, past float16's
    65504)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.inner = TinyConvEncoder()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out * float("nan") if self.how == "nan" else out * 1e6


@pytest.mark.parametrize(("how", "dtype"), [("huge", "float16"), ("nan", "float32")])
def test_a_row_not_finite_as_stored_is_refused_never_returned_or_kept(
    tmp_path: Path, how: str, dtype: str
) -> None:
    """A row whose stored form holds NaN or inf (float16's cast of values past its range too)
    was returned and cached, in RAM and on disk, as a build never stores it. Now the call is
    refused in one line naming the row and the dtype, and nothing is kept: the same call again
    runs the encoder again, in this process and in a fresh one."""
    from featbake.errors import EncodeError

    enc = frozen(_Off(how))
    x = dtype_waves(1)
    want = rf"^the row with id 'u1': the encoder returned NaN .*\(stored as {dtype}\); not served"
    for _ in range(2):
        cached = CachedEncoder(enc, cache=tmp_path / "c", dtype=dtype)
        for _ in range(2):
            with pytest.raises(EncodeError, match=want):
                cached(x, ids=["u1"])
        assert cached.cache_info()["encoded"] == 2
        cached.flush()
    with pytest.raises(EncodeError, match=r"^row 0 of the batch: the encoder returned NaN"):
        cached(x)


@pytest.mark.parametrize("compile_as", ["trace", "script", "traced-inside-a-module"])
def test_a_torchscript_encoder_is_cached_watched_and_said_when_trainable(
    tmp_path: Path, compile_as: str
) -> None:
    """A ``torch.jit.trace``d module keeps its parameters in its C++ object, not in
    ``vars()``: reading its tree state raised ``KeyError: '_parameters'`` at the first call; a
    scripted one in train mode (``.training`` lives there too) was cached as if in eval mode,
    and its first bare call (which keeps its compiled ``forward`` on the instance) keyed it
    apart from then on. Now each is cached, an in-place weight edit is never served stale, and
    a trainable or train-mode one runs uncached with the warning."""
    x = waves(3)
    tiny = TinyConvEncoder()
    compiled = torch.jit.script(tiny) if compile_as == "script" else torch.jit.trace(tiny, x)
    enc = Counting(compiled) if compile_as == "traced-inside-a-module" else compiled
    ce = CachedEncoder(enc, cache=tmp_path / "store")
    with pytest.warns(UserWarning, match=r"requires_grad_\(False\)"):
        ce(x)
    frozen(enc)
    compiled.train()
    with pytest.warns(UserWarning, match="training mode"):
        ce(x)
    assert ce.cache_info()["encoded"] == 0
    compiled.eval()
    first = ce(x)
    same(first, compiled(x))  # the bare call, as a user's own check would make it
    same(ce(x), compiled(x))
    assert ce.cache_info()["encoded"] == 3  # the second call hit
    with torch.no_grad():
        next(compiled.parameters()).mul_(2.0)
    after = ce(x)
    same(after, compiled(x))
    assert not torch.equal(first, after) and ce.cache_info()["encoded"] == 6


class _TanhConvEncoder(TinyConvEncoder):
    """``TinyConvEncoder``'s weights, other code: ``tanh`` where it runs ``gelu``; named as
    it is (its ``forward`` edited, as a user edits a class and compiles it again)."""

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(wav.unsqueeze(1)))
        return torch.tanh(self.conv2(x)).transpose(1, 2)


_TanhConvEncoder.__name__ = _TanhConvEncoder.__qualname__ = TinyConvEncoder.__name__


@pytest.mark.parametrize("make", ["script", "trace", "freeze"])
def test_torchscript_modules_of_other_code_or_frozen_weights_are_keyed_apart(
    tmp_path: Path, make: str
) -> None:
    """Two TorchScript modules on one store: the same weights with other code (scripted or
    traced), or the same code frozen with other weights (``torch.jit.freeze`` makes them
    constants: no parameter left). The second is served what it computes, not the first's
    features. Before, its class (torch's) and repr were all its key read of its code, and a
    frozen module's weights were read by none: the second was served the first's features
    (and a plainly frozen module, which keeps no ``training``, raised AttributeError)."""
    x = waves(2)

    def compiled(module: nn.Module) -> Any:
        module = frozen(module)
        if make == "trace":
            return torch.jit.trace(module, x)
        scripted = torch.jit.script(module)
        return torch.jit.freeze(scripted) if make == "freeze" else scripted

    first = compiled(TinyConvEncoder(seed=1))
    second = compiled(TinyConvEncoder(seed=2) if make == "freeze" else _TanhConvEncoder(seed=1))
    for module in (first, second):
        ce = CachedEncoder(module, cache=tmp_path / "store")
        same(ce(x, ids=["a", "b"]), module(x))
        same(ce(x, ids=["a", "b"]), module(x))
        assert ce.cache_info()["encoded"] == 2
        ce.flush()


class TimeFirstLSTM(nn.Module):
    """torch's default recurrent layout: ``[T, B, D]`` in and out."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


@pytest.mark.parametrize("kind", ["transformer", "lstm"])
def test_a_time_first_encoder_is_refused_not_served_other_sequences_steps(
    tmp_path: Path, kind: str
) -> None:
    """A module whose dimension 0 is time (``batch_first=False``, torch's default for
    ``nn.TransformerEncoder`` and ``nn.LSTM``) had each time step cached as a row: a second
    call sharing its zero-padded tail steps was served the first call's (3.0 off for the
    transformer, 0.14 for the LSTM), with no warning. Its first call of several rows is
    refused in one line naming batch_first; a [B, T, D] module of the same layers is served
    as run now."""
    from featbake.errors import EncodeError

    torch.manual_seed(0)
    if kind == "transformer":
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, dropout=0.0)
        module: nn.Module = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    else:
        module = TimeFirstLSTM()
    enc = frozen(module)
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    x = torch.randn(6, 2, 16)
    x[4:] = 0  # padded tails, as two calls of padded sequences share
    with pytest.raises(EncodeError, match="batch_first=False") as refused, torch.no_grad():
        ce(x)
    assert "\n" not in str(refused.value)
    assert ce.stats["encoded"] == 0

    class BatchFirst(nn.Module):  # the same layers, batch first: rows are independent
        def __init__(self) -> None:
            super().__init__()
            self.inner = enc

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.transpose(0, 1)).transpose(0, 1)

    wrapped = frozen(BatchFirst())
    ce = CachedEncoder(wrapped, cache=tmp_path / "s2")
    rows = x.transpose(0, 1).contiguous()
    with torch.no_grad():
        same(ce(rows), wrapped(rows))
        other = torch.randn(3, 6, 16)
        other[0] = rows[1]  # one row cached, two new
        same(ce(other), wrapped(other))
    assert ce.stats["encoded"] == 4


class LogEnergy(nn.Module):
    """Frames' log energy (-inf on zero padding) and a code per frame (an int part)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        frames = x.reshape(x.shape[0], -1, 160)
        energy = (frames * self.scale).pow(2).sum(-1).log()
        return {"energy": energy, "codes": (frames.sum(-1) > 0).long()}


def test_rows_whose_outputs_hold_infinities_or_codes_are_not_refused(tmp_path: Path) -> None:
    """The row check compared ``inf - inf`` (NaN) with its tolerance and refused an encoder
    whose log energy is -inf on zero padding as "not independent ... batch_first=False"; it
    compares infinities and NaNs by where they are, and int parts (codes) not at all."""
    enc = frozen(LogEnergy())
    ce = CachedEncoder(enc, cache=tmp_path / "s")
    x = waves(3)[:, :1600].clone()
    x[1:, 800:] = 0  # two rows padded with zeros: -inf energy there
    with torch.no_grad():
        got, want = ce(x), enc(x)
    assert torch.isinf(want["energy"]).any()
    torch.testing.assert_close(got["energy"], want["energy"])
    assert torch.equal(got["codes"], want["codes"])
    assert ce.stats["encoded"] == 3
