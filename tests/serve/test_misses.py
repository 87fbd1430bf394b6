"""A refused miss says what differs and what to run; it leaves nothing behind (issue 18 item 6)."""

from __future__ import annotations

import dataclasses
import fractions
import functools
import logging
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featbake.bake.pipeline import build
from featbake.errors import CacheMiss, EncoderLoadError, StoreError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.serve.misses import StoredBuild, build_options, miss_message
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder
from tests.conftest import live_features
from tests.helpers import script_lines


def _root_names(store: Path) -> set[str]:
    with Catalog(Layout(store), read_only=True) as catalog:
        return {r.name for r in catalog.roots()}


def test_a_dtype_miss_names_the_field_the_command_and_leaves_no_root(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    report = build(audio_dir, encoder_file, cache=store_dir, workers=0)  # float32
    ds = CachedFeatureDataset(
        audio_dir, encoder_file, cache=store_dir, dtype="float16", on_miss="error"
    )
    with pytest.raises(CacheMiss) as err:
        ds[0]
    text = str(err.value)
    assert "dtype='float32' in the store, 'float16' asked" in text
    assert f"--cache {store_dir}" in text and "--dtype float16" in text
    assert _root_names(store_dir) == {report.root}  # the refused dataset published nothing
    # What the message says to pass works: the store's dtype serves, equal to live.
    ok = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, on_miss="error")
    torch.testing.assert_close(ok[0], live_features(encoder_file, Path(ok.path(0))))


def test_a_mistyped_cache_path_is_no_store_not_a_miss(
    audio_dir: Path, encoder_file: Path, tmp_path: Path
) -> None:
    typo = tmp_path / "stroe"
    with pytest.raises(StoreError, match=f"there is no featbake store at {typo}"):
        CachedFeatureDataset(audio_dir, encoder_file, cache=typo, on_miss="error")
    assert not typo.exists()
    with pytest.warns(UserWarning, match="no featbake store at .* yet: creating one"):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=typo)
    torch.testing.assert_close(ds[1], live_features(encoder_file, Path(ds.path(1))))


def test_the_message_for_another_encoder_and_the_options_it_carries() -> None:
    other = [StoredBuild("teacher.pt", {"dtype": "float32"})]
    text = miss_message("/d/a.wav", "/s", "student.pt", "/d", {"dtype": "float32"}, other)
    assert "another encoder (teacher.pt), not student.pt" in text
    assert "featbake build --encoder student.pt --data /d --cache /s" in text
    from featbake.recipe import Recipe

    asked = {**Recipe().as_dict(), "layers": [0, 6], "mono": False, "max_seconds": 4.0}
    assert build_options(asked) == ["--max-seconds 4.0", "--layers 0,6", "--no-mono"]
    text_fields = {"max_length": 77, "truncate": True, "lowercase": False, "special_tokens": False}
    texts = {**Recipe(source="text").as_dict(), "text": text_fields}
    assert build_options(texts) == ["--source text", "--max-tokens 77", "--no-special-tokens"]
    manifest = miss_message("/d/c.jsonl:3", "/s", "bert", "/d/c.jsonl", texts, [], "caption")
    assert "--data /d/c.jsonl --column caption --cache /s --source text" in manifest


def test_cache_info_in_the_main_process_says_workers_count_apart(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """Issue 18 item 7: after an epoch with workers, cache_info() here showed zeros, silently."""
    import warnings

    from torch.utils.data import DataLoader

    build(audio_dir, encoder_file, cache=store_dir, workers=0)
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, ram_cache="8MiB")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in DataLoader(ds, batch_size=None):  # read here: counted here, nothing to say
            pass
        assert ds.cache_info().store_reads == len(ds)
    for _ in DataLoader(ds, batch_size=None, num_workers=2):
        pass
    with pytest.warns(UserWarning, match="DataLoader workers count .* in their own processes"):
        info = ds.cache_info()
    assert info.store_reads == len(ds)  # this process's own, from the first epoch


def test_one_part_of_a_whole_output_store_is_copied_for_webdataset_members_not_encoded(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path
) -> None:
    """A dataset asking one part (``Recipe(output="pooled")``) over webdataset shards whose
    store holds the whole output copies the stored part, as it does over a folder: before, the
    members' digests were looked up as if they were files, none was found, and every item was
    encoded live without a word (issue 43 item 3)."""
    import io
    import tarfile

    from featbake.bake.pipeline import build
    from featbake.recipe import Recipe
    from featbake.serve.dataset import CachedFeatureDataset
    from tests.helpers import Live

    clips = sorted(audio_dir.rglob("*.wav"))[:4]
    shard = tmp_path / "shard-000.tar"
    with tarfile.open(shard, "w") as tf:
        for i, clip in enumerate(clips):
            data = clip.read_bytes()
            info = tarfile.TarInfo(f"s{i:02d}.wav")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    store = tmp_path / "store"
    assert build(shard, multi_encoder_file, cache=store, workers=0).encoded == 4
    ds = CachedFeatureDataset(
        shard, multi_encoder_file, cache=store, recipe=Recipe(output="pooled")
    )
    live = Live()
    for i, clip in enumerate(clips):
        torch.testing.assert_close(ds[i], live(multi_encoder_file, clip)["pooled"])
    info = ds.cache_info()
    assert info.encoded == 0, info  # every part was copied from the whole output


def test_the_live_encoding_warning_looks_at_every_stored_build_of_the_data() -> None:
    """With a whole-output build and another beside it, a dataset asking one part copies it
    from the whole output: no warning. Before, only the first build listed was compared, so the
    warning named that build's options and said items would be encoded live, and none was."""
    from featbake.serve.misses import live_encoding_warning

    asked = {"dtype": "float32", "output": "pooled", "crop": 196}
    other = StoredBuild("enc", {"dtype": "float16", "output": "pooled", "crop": 224})
    whole = StoredBuild("enc", {"dtype": "float32", "output": None, "crop": 196})
    assert live_encoding_warning("imgs", 3, 3, "enc", asked, [other, whole]) is None
    near = StoredBuild("enc", {"dtype": "float32", "output": "pooled", "crop": 224})
    told = live_encoding_warning("imgs", 3, 3, "enc", asked, [other, near])
    assert told is not None and "crop=224" in told and "dtype" not in told.split("options:")[1]


@pytest.mark.parametrize("many", [False, True], ids=["item", "batch"])
def test_a_miss_edited_in_place_by_the_caller_is_never_stored_or_served_edited(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path, many: bool
) -> None:
    """A miss is encoded live and written back; the tensor served was the very one the
    write-back held until it sealed, so a loop normalising its item in place (``x -= mean``)
    sealed its edit into the store under the item's key (every later run served it) and a
    second read before the seal served it too. Before: the pooled vector zeroed by the caller
    was served again, and stored."""
    from featbake.recipe import Recipe
    from tests.helpers import Live

    store = tmp_path / "fresh"
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, multi_encoder_file, cache=store, output="pooled")
    got = ds.__getitems__([0, 1]) if many else [ds[0], ds[1]]
    for value in got:
        value.mul_(0.0)  # the caller's own edit of what it was served
    live = Live()
    want = [live(multi_encoder_file, Path(ds.path(i)))["pooled"] for i in (0, 1)]
    for i in (0, 1):  # pending in the write-back: served as encoded, not as edited
        again = ds[i]
        torch.testing.assert_close(again, want[i])
        again.mul_(0.0)  # an edit of a pending read neither
    ds.flush()
    ok = CachedFeatureDataset(
        audio_dir, multi_encoder_file, cache=store, recipe=Recipe(output="pooled"), on_miss="error"
    )
    for i in (0, 1):
        torch.testing.assert_close(ok[i], want[i])
    assert ok.cache_info().encoded == 0  # read from the store, as stored


def test_what_the_ram_tier_serves_is_the_callers_own(
    audio_dir: Path, encoder_file: Path, store_dir: Path
) -> None:
    """The RAM tier kept the very tensor it served, from a store read, a miss encoded live
    or a hit: a step that normalised its item in place (``ds[i]``, or a loader with
    ``collate_fn=list``) changed what every later read of that item served, the rest of the
    run (the first reads of an epoch of 8 edited in place: all 8 wrong in the next). What is
    served is now the caller's own; the tier keeps a copy."""
    from featbake.serve.loader import FeatureLoader
    from tests.helpers import Live

    build(audio_dir / "fixed", encoder_file, cache=store_dir, workers=0)  # 4 of 16 stored
    ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store_dir, ram_cache="64MiB")
    live = Live()
    want = [live(encoder_file, Path(ds.path(i))) for i in range(len(ds))]
    stored = [i for i in range(len(ds)) if "fixed" in ds.path(i)]
    for i in (stored[0], 0 if stored[0] else 1):  # a store read, then a miss encoded live
        for _ in range(3):  # read from the store (or encoded), then twice from the tier
            value = ds[i]
            torch.testing.assert_close(value, want[i])
            value.sub_(value.mean()).mul_(0)  # the caller's own edit
    loader = FeatureLoader(ds, batch_size=8, shuffle=False, collate_fn=list)
    for _epoch in range(2):
        for batch in loader:
            for value in batch:
                value.mul_(0)
    assert ds.cache_info().hits > 0
    for i in range(len(ds)):
        torch.testing.assert_close(ds[i], want[i])


class _Tallying(torch.nn.Module):
    """TinyConvEncoder's forward, counting its calls in a plain attribute and the samples it
    saw in a buffer it replaces (a module's own bookkeeping while it runs, as a cache of
    rotary tables is)."""

    def __init__(self) -> None:
        super().__init__()
        from featbake.testing import TinyConvEncoder

        self.inner = TinyConvEncoder()
        self.calls = 0
        self.register_buffer("samples", torch.zeros(1), persistent=False)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.samples = self.samples + wav.shape[-1]
        return self.inner(wav)


def test_an_in_process_module_changed_after_the_dataset_was_made_encodes_no_miss(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A dataset's keys are made from its module's fingerprint when it is created; a module
    updated after (weights through ``.data``, as an EMA teacher's) encoded the next misses and
    they were stored under the old keys, so every later dataset over the unchanged module was
    served the changed module's features as hits. Now the miss is refused in one line; misses
    of the unchanged module (which counts its own calls) are encoded and stored as before."""
    from featbake.encode.sources import source_for
    from featbake.errors import EncoderLoadError
    from featbake.recipe import Recipe

    def live(module: torch.nn.Module, path: str) -> torch.Tensor:
        with torch.inference_mode():
            return module(source_for(Recipe()).load(Path(path)).unsqueeze(0))[0]

    store = tmp_path / "fresh"
    module = _Tallying().eval()
    ds = _fresh_dataset(audio_dir, module, store)
    first = [ds[0], ds[1]]  # two misses, the module counting its calls between them
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)  # behind the version counter
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[2]
    assert "\n" not in str(e.value)
    ds.flush()
    original = _Tallying().eval()
    again = CachedFeatureDataset(audio_dir, original, cache=store, on_miss="error")
    for i in (0, 1):
        torch.testing.assert_close(again[i], live(original, again.path(i)))
        torch.testing.assert_close(first[i], again[i])
    with pytest.raises(CacheMiss):
        again[2]  # nothing stored from the changed module


def test_a_write_back_sealed_after_its_item_was_re_keyed_leaves_the_item_where_it_is(
    tmp_path: Path, encoder_file: Path
) -> None:
    """``revalidate=True``: an item encoded on a miss (pending in the write-back), then its file
    rewritten with a clip the store holds, is served that clip's stored feature; when the old
    bytes' feature sealed after, the dataset pointed the item at that shard, and its next read
    failed with "shard ... holds no tensor ... run `featbake verify --repair`" about a store
    with nothing wrong in it. A seal now points only the items whose key it holds."""
    import shutil

    from featbake.testing import write_audio_folder
    from tests.helpers import Live, bake

    data, other = tmp_path / "data", tmp_path / "other"
    write_audio_folder(data, 3, seconds=0.5, seed=4)
    write_audio_folder(other, 1, seconds=0.5, seed=9)
    store = tmp_path / "store"
    bake(other, encoder_file, store)  # the store holds the other clip's features

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    ds = CachedFeatureDataset(data, encoder_file, cache=store, revalidate=True, clock=clock)
    clip = Path(ds.path(0))
    ds[0]  # a miss: encoded, pending in the write-back
    shutil.copyfile(next(other.rglob("*.wav")), clip)  # the clip the store holds
    live = Live()
    torch.testing.assert_close(ds[0], live(encoder_file, clip))  # re-keyed: a hit
    clock.now += 60  # the old bytes' feature is due ...
    ds[1]  # ... and seals
    assert ds.cache_info().written == 2
    for _ in range(2):
        torch.testing.assert_close(ds[0], live(encoder_file, clip))
        torch.testing.assert_close(ds.__getitems__([0, 1])[0], live(encoder_file, clip))


SPAWNED_MISSES = """
import sys, warnings
from pathlib import Path
from typing import Any
import torch
from torch.utils.data import DataLoader
from featbake.encode.sources import source_for
from featbake.errors import EncoderLoadError
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.testing import TinyConvEncoder


class Enc(torch.nn.Module):  # a class of the script run: __mp_main__'s in a spawned worker
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv1d(1, 8, 400, stride=160)

    def forward(self, wav):
        return self.conv(wav.unsqueeze(1)).transpose(1, 2)


def pre(module, args):  # a hook of the script run: __mp_main__'s in a spawned worker
    return (args[0] * 2.0,)


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    data, store = Path(sys.argv[1]), Path(sys.argv[2])
    module = Enc().eval()
    ds = CachedFeatureDataset(data, module, cache=store)
    spawn = dict(batch_size=None, num_workers=1, multiprocessing_context="spawn")
    for i, item in enumerate(DataLoader(ds, **spawn)):
        with torch.inference_mode():
            want = module(source_for(Recipe()).load(Path(ds.path(i))).unsqueeze(0))[0]
        torch.testing.assert_close(item, want)
    print("served", len(ds))
    again = CachedFeatureDataset(data, module, cache=store.parent / "other")
    with torch.no_grad():
        module.conv.weight.data.mul_(2.0)
    try:
        list(DataLoader(again, **spawn))
    except EncoderLoadError as e:
        print("refused:", str(e).splitlines()[-1][:120])
    hooked = TinyConvEncoder().eval()  # :func:`test_a_refusal_in_a_spawned_worker_names_...`
    hooked.register_forward_pre_hook(pre)
    ds = CachedFeatureDataset(data, hooked, cache=store.parent / "hooked")
    hooked.conv2.dilation = (2,)  # the real change: a plain attribute, no hook
    try:
        list(DataLoader(ds, **spawn))
    except Exception as e:
        print("hooked:", str(e).splitlines()[-1])
"""


def test_a_module_of_the_script_encodes_misses_in_spawned_workers_until_it_changes(
    spawned_misses: list[str],
) -> None:
    """The change check of an in-process module must not take a spawned worker's copy for a
    change: there a class of the script run is ``__mp_main__``'s, and hashing its identity
    again gave another fingerprint, so every miss in a spawned worker was refused. The copy is
    checked when it is pickled and trusted where it lands; a module changed before the workers
    started is refused there."""
    lines = spawned_misses
    assert lines[0] == "served 3", lines
    assert lines[1].startswith("refused: ") and "changed" in lines[1], lines


@pytest.fixture(scope="module")
def spawned_misses(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The lines :data:`SPAWNED_MISSES` prints, run once for the tests of spawned workers."""
    return script_lines(tmp_path_factory.mktemp("spawned"), SPAWNED_MISSES, clips=3)


def _fresh_dataset(data: Path, encoder: Any, store: Path) -> CachedFeatureDataset:
    """A dataset over ``data`` into a store not made yet (its warning checked)."""
    with pytest.warns(UserWarning, match="no featbake store"):
        return CachedFeatureDataset(data, encoder, cache=store)


def _calls_to(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """The first argument of each call to ``module.name`` from now on (it still runs)."""
    calls: list[Any] = []
    real = getattr(module, name)

    def counted(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(first)
        return real(first, *args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _live(module: torch.nn.Module, path: str) -> torch.Tensor:
    """The module's output for one file, computed now."""
    from featbake.encode.sources import source_for
    from featbake.recipe import Recipe

    with torch.inference_mode():
        return module(source_for(Recipe()).load(Path(path)).unsqueeze(0))[0]


class _Normalised(torch.nn.Module):
    """An encoder with batch norm and dropout: in train mode its output is not its eval one."""

    def __init__(self) -> None:
        super().__init__()
        from featbake.testing import TinyConvEncoder

        self.inner = TinyConvEncoder()
        self.bn = torch.nn.BatchNorm1d(64)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        x = self.inner(wav)
        return self.drop(self.bn(x.transpose(1, 2)).transpose(1, 2))


def test_an_encoder_module_put_in_train_mode_encodes_no_miss(
    tmp_path: Path, audio_dir: Path
) -> None:
    """The dataset's module is a submodule of the model being trained: ``model.train()`` after
    the dataset was made put it in train mode, and its misses were encoded so (dropout zeros,
    batch statistics moved) and stored under the keys of its eval mode. Now the miss is refused
    in one line and leaves the module as it was; back in eval mode the misses are its eval
    features."""
    from featbake.errors import EncoderLoadError

    model = torch.nn.ModuleDict({"enc": _Normalised(), "head": torch.nn.Linear(64, 2)})
    ds = _fresh_dataset(audio_dir, model["enc"], tmp_path / "s")
    model.train()  # the training loop's, each epoch
    statistics = model["enc"].bn.running_mean.clone()
    with pytest.raises(EncoderLoadError, match=r"train mode .*call \.eval\(\)") as e:
        ds[0]
    assert "\n" not in str(e.value)
    assert torch.equal(statistics, model["enc"].bn.running_mean)
    model["enc"].eval()
    served = ds[0]
    ds.flush()
    again = CachedFeatureDataset(audio_dir, model["enc"], cache=tmp_path / "s", on_miss="error")
    torch.testing.assert_close(served, _live(model["enc"], ds.path(0)))
    torch.testing.assert_close(again[0], _live(model["enc"], ds.path(0)))


def test_an_exported_programs_module_serves_its_features_and_its_train_mode_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``torch.export``'s ``ep.module()`` refuses ``.eval()`` (``NotImplementedError``): its
    mode was fixed when it was traced. Before, a dataset over it failed as it was made, with
    torch's traceback, since the dataset put its module in eval mode. Now its mode is left as
    the graph has it: exported in eval mode, its misses are its features; exported in train
    mode (dropout's ``train=True`` in the graph), the miss is refused in one line."""
    from torch.export import Dim

    from featbake.errors import EncoderLoadError

    shapes = {"wav": {0: Dim.AUTO, 1: Dim.AUTO}}
    module = torch.export.export(TinyConvEncoder().eval(), (torch.randn(2, 16000),),
                                 dynamic_shapes=shapes).module()  # fmt: skip
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))
    dropping = torch.nn.Sequential(TinyConvEncoder(), torch.nn.Dropout(0.5)).train()
    trained = torch.export.export(dropping, (torch.randn(2, 16000),),
                                  dynamic_shapes={"input": shapes["wav"]}).module()  # fmt: skip
    ds = _fresh_dataset(audio_dir, trained, tmp_path / "t")
    with pytest.raises(EncoderLoadError, match="train") as e:
        ds[0]
    assert "\n" not in str(e.value)


def test_a_module_shared_by_two_datasets_encodes_misses_for_both(
    tmp_path: Path, audio_dir: Path
) -> None:
    """One module (counting its calls) given to a train and a val dataset: the misses of one
    ran it, and the other's next miss was refused as a change, as was a miss after the user's
    own call of the module. Every run of the module is its bookkeeping, whoever calls it; a
    change made outside a run is still refused."""
    from featbake.errors import EncoderLoadError
    from featbake.testing import write_audio_folder

    write_audio_folder(tmp_path / "val", 3, seconds=0.5, seed=7)
    module = _Tallying().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        train = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
        val = CachedFeatureDataset(tmp_path / "val", module, cache=tmp_path / "s")
    served = [(val, 0, val[0]), (train, 0, train[0]), (val, 1, val[1])]
    module(torch.zeros(1, 8000))  # the user's own call between misses
    served.append((train, 1, train[1]))
    for ds, i, value in served:
        torch.testing.assert_close(value, _live(module, ds.path(i)))
    module.calls = 0  # set from outside a run: a change
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        val[2]


def test_a_loaded_encoder_of_a_file_changed_after_the_dataset_was_made_encodes_no_miss(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``load_encoder(file)`` handed to a dataset was never watched: its weights doubled in
    place after the dataset was made, the next miss was encoded with them and written back
    under the keys of the file's weights. Now it is refused in one line, as for a module."""
    from featbake.encode.loaders import load_encoder
    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder, save_torchscript

    enc = load_encoder(save_torchscript(TinyConvEncoder(), tmp_path / "e.pt"))
    ds = _fresh_dataset(audio_dir, enc, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(enc.module, ds.path(0)))
    torch.testing.assert_close(ds[1], _live(enc.module, ds.path(1)))  # its own runs: trusted
    with torch.no_grad():
        for p in enc.module.parameters():
            p.mul_(2.0)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[2]
    assert "\n" not in str(e.value)


def test_the_change_check_reads_the_weights_once_per_batch_of_misses(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check that an in-process module did not change read every weight twice per batch
    of misses (before the run, and again to trust the run): a few percent of encoding a clip
    with a wav2vec2-sized model. The run now reuses the probe taken just before it where no
    version or pointer moved, so each weight is read once; a write behind the version
    counters between batches is still refused."""
    import featbake.serve.cached_encoder as cached_encoder
    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    read = _calls_to(monkeypatch, cached_encoder, "crc32c_tensor")
    served = ds[1]
    tensors = [*module.parameters(), *module.buffers()]
    assert sorted(t.data_ptr() for t in read) == sorted(t.data_ptr() for t in tensors)
    torch.testing.assert_close(served, _live(module, ds.path(1)))
    with torch.no_grad():
        module.conv2.weight.data.mul_(2.0)
        module(torch.zeros(1, 8000))  # the user's own run after the write: no weight read
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[2]


def test_a_miss_is_copied_once_on_its_way_to_the_caller_and_the_write_back(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each miss was copied twice: its row out of the encoded batch, then the write-back's own
    copy (about 1 ms per 9 MB item). The row stays a view of its batch for the write-back now,
    and the caller is served a copy of its own: one copy, and an item edited in place by the
    caller still reaches neither the store nor a later read."""
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    copies: list[tuple[int, ...]] = []
    clone = torch.Tensor.clone

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(tuple(t.shape))
        return clone(t, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "clone", counted)
    served = ds[0]
    monkeypatch.undo()
    assert copies == [tuple(served.shape)]
    want = _live(module, ds.path(0))
    torch.testing.assert_close(served, want)
    served.zero_()  # the caller's own edit
    torch.testing.assert_close(ds[0], want)  # pending: not the edited copy
    ds.flush()
    again = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s", on_miss="error")
    torch.testing.assert_close(again[0], want)


# -- round seven: the watch of an in-process module -------------------------------------------
class _Gained(torch.nn.Module):
    """TinyConvEncoder's features times a plain float and the first of a list of gains (a
    list: a value edited in place, the same object before and after)."""

    def __init__(self) -> None:
        super().__init__()
        from featbake.testing import TinyConvEncoder

        self.inner = TinyConvEncoder()
        self.scale = 1.0
        self.gains = [1.0]

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.inner(wav) * self.scale * self.gains[0]


def _users_forward(module: torch.nn.Module) -> None:
    """The user's own call of the module (a teacher run in the training step)."""
    dtype = next(module.parameters()).dtype
    with torch.no_grad():
        module(torch.zeros(1, 8000, dtype=dtype))


def test_a_watched_modules_own_forward_digests_no_attribute(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hooks that follow a dataset's module run on every forward, the user's own too, and
    each digested every submodule's attributes and listed its tensors twice per forward:
    2.8 ms on a wav2vec2-base sized model, paid each training step by a teacher also run
    there. A forward of an unchanged module now compares a glance (ids, versions, pointers)
    and digests nothing; a change made before it is still refused."""
    import featbake.serve.cached_encoder as cached_encoder
    from featbake.errors import EncoderLoadError

    module = _Gained().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    digested = _calls_to(monkeypatch, cached_encoder, "structure_read")
    for _ in range(3):
        _users_forward(module)
    assert digested == []
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    module.scale = 2.0
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[2]


def _ema_step(m: _Gained) -> None:
    m.inner.conv2.weight.data.mul_(0.5)


def _new_checkpoint(m: _Gained) -> None:
    m.load_state_dict({k: v * 2 for k, v in m.state_dict().items()})


def _parameter_replaced(m: _Gained) -> None:
    m.inner.conv2.weight = torch.nn.Parameter(m.inner.conv2.weight * 2)


def _submodule_replaced(m: _Gained) -> None:
    import copy

    other = copy.deepcopy(m.inner.conv2)
    other.weight.data.mul_(2.0)
    m.inner.conv2 = other


def _list_edited(m: _Gained) -> None:
    m.gains[0] = 2.0


@pytest.mark.parametrize(
    "change",
    [
        _ema_step,
        _new_checkpoint,
        _parameter_replaced,
        _submodule_replaced,
        lambda m: setattr(m, "scale", 2.0),
        _list_edited,
        lambda m: m.double(),
    ],
    ids=[
        "ema-through-data",
        "load_state_dict",
        "parameter",
        "submodule",
        "attribute",
        "list",
        "to-float64",
    ],
)
def test_a_change_before_the_users_own_forward_is_still_refused(
    tmp_path: Path, audio_dir: Path, change: Any
) -> None:
    """Each way a module changes after its dataset was made, then a forward of the user's own
    (whose hooks take what a run changes as bookkeeping, and since round seven compare a
    glance only): the next miss is refused in one line, as it was when every forward read the
    module exactly. A list edited in place is the same object before and after: the glance
    reads such lists by value."""
    from featbake.errors import EncoderLoadError

    module = _Gained().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    with torch.no_grad():
        change(module)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[1]
    assert "\n" not in str(e.value)


def test_what_a_users_forward_leaves_as_it_was_is_no_change(
    tmp_path: Path, audio_dir: Path
) -> None:
    """What differs in a glance but not in the module (a float and a list set again to the
    values they had, ``.train()`` for a training step and ``.eval()`` after, a forward under
    ``inference_mode``) is no change: the misses after are encoded, equal to the module run
    now."""
    module = _Gained().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    module.scale = float(str(module.scale))  # another object of the same value
    module.gains = [1.0]
    _users_forward(module)
    module.train()
    _users_forward(module)
    module.eval()
    with torch.inference_mode():
        module(torch.zeros(1, 8000))
    for i in (1, 2):
        torch.testing.assert_close(ds[i], _live(module, ds.path(i)))


def test_a_write_behind_the_version_counter_before_a_run_that_replaces_a_buffer_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A module that replaces a buffer in each run (a cache of rotary tables, a sample count),
    its weight written through ``.data`` (an EMA step), then run by the user: the run's end
    read every weight again and took the write as the run's own, so the next miss was
    encoded with the written weights under the old keys. Now only the tensors the run moved
    are read again, and the write is refused."""
    from featbake.errors import EncoderLoadError

    module = _Tallying().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))
    _users_forward(module)  # its bookkeeping: no change
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[2]


class _LazyCache(torch.nn.Module):
    """TinyConvEncoder's forward, registering a cache buffer the first time it runs (as
    rotary or positional tables are made on first use): that run adds a tensor."""

    def __init__(self) -> None:
        super().__init__()
        from featbake.testing import TinyConvEncoder

        self.inner = TinyConvEncoder()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "cache"):
            self.register_buffer("cache", torch.zeros(1), persistent=False)
        return self.inner(wav) + self.cache


def test_a_write_behind_the_version_counter_before_a_run_that_adds_a_tensor_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """Review of serve7.2: a run that changed how many tensors the module has (a buffer made on
    first use) read every weight again, taking a write through ``.data`` made before it as the
    run's own, so the next miss was encoded with the written weights under the old keys. Now
    the tensors that were there before keep their trusted entries (matched by version and
    pointer); only the new ones are read."""
    from featbake.errors import EncoderLoadError

    module = _LazyCache().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)
    _users_forward(module)  # its first run: the cache buffer is made
    assert hasattr(module, "cache")
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[0]


def test_a_compiled_watched_module_runs_and_its_change_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``torch.compile`` (the eager backend) over a dataset's module: its compiled calls run
    the watch's hooks, so its bookkeeping between misses is no change, and a write behind
    its version counters before a compiled call is refused at the next miss."""
    from featbake.errors import EncoderLoadError

    module = _Tallying().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    compiled = torch.compile(module, backend="eager")
    x = torch.randn(1, 8000)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), module(x))
        compiled(x)
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)
        compiled(x)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[2]


def test_a_module_moved_off_its_weights_after_the_dataset_was_made_is_refused_in_one_line(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``.to("meta")`` after the dataset was made: the next miss failed with torch's
    ``NotImplementedError: Cannot copy out of meta tensor``; ``.double()`` was refused as a
    change of "its weights or attributes". Now the first is refused in one line saying the
    weights are gone and how to load them back, the second names both dtypes and the call
    that brings the module back; once back, misses are encoded again, equal to the module run
    now."""
    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    module.to("meta")
    with pytest.raises(EncoderLoadError, match=r"on the meta device .*load_state_dict") as e:
        ds[1]
    assert "\n" not in str(e.value)
    module.load_state_dict(weights, assign=True)
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    module.double()
    with pytest.raises(EncoderLoadError, match=r"torch.float64 now, torch.float32 then") as e:
        ds[2]
    assert r".to(torch.float32)" in str(e.value) and "\n" not in str(e.value)
    module.to(torch.float32)
    torch.testing.assert_close(ds[2], _live(module, ds.path(2)))


def test_the_watch_keeps_no_replaced_weight_or_submodule_alive(
    tmp_path: Path, audio_dir: Path
) -> None:
    """What the watch keeps to compare a forward with (its glance, the glance's plan) holds
    modules and tensors weakly: a weight or submodule replaced after the dataset was made is
    freed with no forward or miss after it (on a GPU, a checkpoint loaded with
    ``assign=True`` would otherwise hold the old weights' memory), and the change is still
    refused."""
    import copy
    import gc
    import weakref

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    _users_forward(module)
    weight, submodule = weakref.ref(module.conv2.weight), weakref.ref(module.conv1)
    module.conv2.weight = torch.nn.Parameter(module.conv2.weight.detach() * 2)
    module.conv1 = copy.deepcopy(module.conv1)
    gc.collect()
    assert weight() is None and submodule() is None
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[1]


# -- round nine: serving misses with an in-process module --------------------------------------
class _Counting(torch.nn.Module):
    """TinyConvEncoder's forward, counting its calls in a plain attribute (its bookkeeping)."""

    def __init__(self) -> None:
        super().__init__()
        from featbake.testing import TinyConvEncoder

        self.inner = TinyConvEncoder()
        self.calls = 0

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(wav)


def _share_memory(m: torch.nn.Module) -> None:
    m.share_memory()  # every tensor's storage moved (as DataLoader users do), values kept


def _meta_and_back(m: torch.nn.Module) -> None:
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    m.to("meta")
    m.load_state_dict(weights, assign=True)  # new tensors, on the CPU again, the same values


@pytest.mark.parametrize(
    ("make", "move"),
    [(_Counting, _share_memory), (_Tallying, _share_memory), (_Counting, _meta_and_back)],
    ids=["counting-shared", "tallying-shared", "counting-meta-and-back"],
)
def test_a_module_moved_then_run_by_the_user_encodes_its_next_miss_and_an_edit_is_refused(
    tmp_path: Path, audio_dir: Path, make: Any, move: Any
) -> None:
    """A module whose weights moved to other storage after the dataset was made (another
    device; shared memory; the meta device and back), then run by the user: the next miss was
    refused as a change, though no weight changed, because the watch compared storage and
    took the move for a change, and the runs' own bookkeeping with it. Weights are compared
    by value now; a move plus a real edit is still refused."""
    from featbake.errors import EncoderLoadError

    module = make().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))
    move(module)
    _users_forward(module)
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    _users_forward(module)
    torch.testing.assert_close(ds[2], _live(module, ds.path(2)))
    move(module)
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)  # a real edit, behind the version counter
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[3]
    assert "\n" not in str(e.value)


def test_a_module_left_partly_on_the_meta_device_is_refused_in_one_line_naming_the_tensor(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``.to("meta")`` then ``load_state_dict(..., assign=True)`` leaves a buffer registered
    with ``persistent=False`` on the meta device (it is in no state dict): the watch looked at
    the first weight only, found it on the CPU, and the miss failed with torch's
    ``NotImplementedError: Cannot copy out of meta tensor``. Any tensor on the meta device is
    refused now, in one line naming it."""
    from featbake.errors import EncoderLoadError

    module = _Tallying().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    _meta_and_back(module)
    assert module.samples.is_meta and not module.inner.conv1.weight.is_meta
    with pytest.raises(EncoderLoadError, match=r"meta device \(samples\).*persistent=False") as e:
        ds[1]
    assert "\n" not in str(e.value)


def test_a_module_moved_to_meta_pickles_to_spawned_workers_which_serve_what_is_stored(
    tmp_path: Path,
) -> None:
    """A module moved to the meta device once its features were stored (to free its memory),
    the dataset then pickled to spawned DataLoader workers: the pickling failed with torch's
    ``NotImplementedError: Cannot copy out of meta tensor`` (the change check hashed the
    weights). Now the workers serve what is stored, and a miss in a copy is refused in one
    line saying to load the weights back."""
    import copy
    import pickle

    from torch.utils.data import DataLoader

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder, write_audio_folder

    write_audio_folder(tmp_path / "data", 3, seconds=0.3, seed=4)
    module = TinyConvEncoder().eval()
    now = copy.deepcopy(module)  # the module as it was, to run now
    first = _fresh_dataset(tmp_path / "data", module, tmp_path / "s")
    for i in range(3):
        first[i]
    first.flush()
    ds = CachedFeatureDataset(tmp_path / "data", module, cache=tmp_path / "s")
    write_audio_folder(tmp_path / "more", 1, seconds=0.3, seed=5)
    more = CachedFeatureDataset(tmp_path / "more", module, cache=tmp_path / "s")
    module.to("meta")
    spawn: dict[str, Any] = dict(batch_size=None, num_workers=1, multiprocessing_context="spawn")
    served = list(DataLoader(ds, **spawn))
    assert len(served) == 3
    for i, item in enumerate(served):
        torch.testing.assert_close(item, _live(now, ds.path(i)))
    copied = pickle.loads(pickle.dumps(more))
    with pytest.raises(EncoderLoadError, match=r"meta device .*load_state_dict") as e:
        copied[0]
    assert "\n" not in str(e.value)


@pytest.mark.filterwarnings("ignore:there is no featbake store")
def test_a_dataset_given_a_module_on_the_meta_device_is_refused_in_one_line(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A module whose only state is a buffer (a mel front-end), on the meta device, given to a
    dataset: ``from_module`` took the CPU for it (it looked at parameters only) and moved the
    user's module there, failing with torch's ``Cannot copy out of meta tensor``; a module
    with parameters on meta failed the same way when hashed. Both are one line now, and the
    module is left where it was."""
    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    for module in (_BufferOnly().to("meta"), TinyConvEncoder().to("meta")):
        with pytest.raises(EncoderLoadError, match=r"on the meta device .*load_state_dict") as e:
            CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
        assert "\n" not in str(e.value)
        assert all(t.is_meta for t in module.buffers())


class _BufferOnly(torch.nn.Module):
    """A front-end whose only state is a buffer (a filter bank): frames of 160 samples, each
    projected on 8 fixed filters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "bank", torch.randn(160, 8, generator=torch.Generator().manual_seed(3))
        )

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        frames = wav[:, : wav.shape[1] // 160 * 160].reshape(wav.shape[0], -1, 160)
        return frames @ self.bank


def test_a_forward_that_changes_only_plain_attributes_digests_none_and_is_no_change(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module counting its calls (``self.calls += 1``) paid the exact check after each of the
    user's forwards (the glance differed, so every attribute was digested and the tree planned
    again: 0.62 ms against 0.14 ms per forward on a 24-layer MLP). A run that changed only
    plain values of attributes the glance planned is taken from the glance now; its digest is
    made from the glance when a check needs it, equal to the module's. A change set from
    outside a run is still refused."""
    import featbake.serve.cached_encoder as cached_encoder
    from featbake.encode.identity import attribute_identity
    from featbake.errors import EncoderLoadError

    module = _Counting().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    digested = _calls_to(monkeypatch, cached_encoder, "structure_read")
    for _ in range(3):
        _users_forward(module)
    assert digested == []
    monkeypatch.undo()
    watch = cached_encoder.shared_watch(module)
    assert watch.trusted_attributes().partition("|")[0] == attribute_identity(module)
    module.share_memory()  # a move: the check compares the attributes with the glance's digest
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    _users_forward(module)
    module.calls = 0  # set from outside a run
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[2]


def _doubled_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward pre-hook scaling the input (as a user's normalisation hook does)."""
    return (args[0] * 2.0,)


def test_a_forward_hook_is_part_of_the_modules_keys_and_one_added_after_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """``register_forward_pre_hook`` changes what the module returns without changing its
    code, weights or attributes: a hook added after the dataset was made encoded the next
    miss with it under the keys of the module without it, and a dataset over a module with a
    hook shared its keys with the module without one, so each was served the other's
    features. A hook is part of the module's identity now (the watch's own left out), and one
    added after is refused in one line, as an attribute set is."""
    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))
    handle = module.register_forward_pre_hook(_doubled_input)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match=r"changed since .*a forward hook was added") as e:
        ds[1]
    assert "\n" not in str(e.value)
    ds.flush()
    hooked = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    assert hooked.key(0) != ds.key(0)
    torch.testing.assert_close(hooked[0], _live(module, hooked.path(0)))
    hooked.flush()
    handle.remove()
    plain = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s", on_miss="error")
    assert plain.key(0) == ds.key(0)
    torch.testing.assert_close(plain[0], _live(module, plain.path(0)))


def test_forwards_of_a_moved_module_read_its_attributes_once_not_at_each_run(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve9.1 follows the runs of a module whose tensors moved (a teacher moved to the GPU
    and run each training step, with no miss to compare its values): the first such run reads
    its attributes once, and each later run as the last one left it compares a glance of the
    moved tree only, its own plain attributes taken from the glance. The next miss compares
    the values and encodes, equal to the module run now."""
    import featbake.serve.cached_encoder as cached_encoder

    module = _Counting().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    module.share_memory()
    digested = _calls_to(monkeypatch, cached_encoder, "structure_read")
    for _ in range(4):
        _users_forward(module)
    assert len(digested) == 1
    monkeypatch.undo()
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))


# == round nine review: a module's structure, its hooks and its values on a device ================
class _WithActivation(torch.nn.Module):
    """TinyConvEncoder's frames through an activation submodule."""

    def __init__(self) -> None:
        from featbake.testing import TinyConvEncoder

        super().__init__()
        self.inner = TinyConvEncoder()
        self.act: torch.nn.Module = torch.nn.Sigmoid()

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.act(self.inner(wav))


class _DoubledConv(torch.nn.Conv1d):
    """A Conv1d whose output is doubled: other code, the same tensors and attributes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2.0


def _conv_replaced(module: torch.nn.Module) -> None:
    old = module.inner.conv2
    new = _DoubledConv(old.in_channels, old.out_channels, kernel_size=3, padding=1)
    new.load_state_dict(old.state_dict())  # equal values, new tensors
    module.inner.conv2 = new


def _activation_replaced(module: torch.nn.Module) -> None:
    module.act = torch.nn.Tanh()  # no tensors, no public attributes either


def _class_set(module: torch.nn.Module) -> None:
    module.inner.conv2.__class__ = _DoubledConv


def _served_as_it_was(
    data: Path, store: Path, ds: CachedFeatureDataset, original: torch.nn.Module
) -> None:
    """A dataset over the module as it was serves its stored item, equal to what it runs now
    (the refused miss left nothing under its keys: it is still a miss)."""
    ds.flush()
    again = CachedFeatureDataset(data, original, cache=store, on_miss="error")
    torch.testing.assert_close(again[0], _live(original, again.path(0)))
    with pytest.raises(CacheMiss):
        again[1]


@pytest.mark.parametrize(
    "change",
    [_conv_replaced, _activation_replaced, _class_set],
    ids=["submodule-replaced", "activation-replaced", "class-set"],
)
def test_a_submodule_of_another_class_after_the_dataset_was_made_is_refused(
    tmp_path: Path, audio_dir: Path, change: Any
) -> None:
    """serve9.1 compared moved tensors by value, so a submodule replaced by one of another
    class with its weights copied (another forward, equal tensors) was taken as a move; an
    activation replaced (no tensors) or ``__class__`` set was never seen. The glance and the
    exact read hold each submodule's class: refused in one line."""
    import copy

    from featbake.errors import EncoderLoadError

    module = _WithActivation().eval()
    original = copy.deepcopy(module)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    change(module)
    module.eval()
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[1]
    assert "\n" not in str(e.value)
    _served_as_it_was(audio_dir, tmp_path / "s", ds, original)


def _scaled(module: torch.nn.Module, args: tuple[Any, ...], factor: float) -> tuple[Any, ...]:
    return (args[0] * factor,)


def _scaling_hook(factor: float) -> Any:
    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * factor,)

    return hook


class _Scaler:
    """A hook object whose factor is an attribute."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0] * self.factor,)


_LAMBDAS = {"double": lambda m, a: (a[0] * 2.0,), "triple": lambda m, a: (a[0] * 3.0,)}


def _replace_hook(old: Any, new: Any) -> Any:
    def change(module: torch.nn.Module, handle: Any) -> None:
        handle.remove()
        module.register_forward_pre_hook(new)

    return old, change


def _set_factor() -> Any:
    hook = _Scaler(2.0)

    def change(module: torch.nn.Module, handle: Any) -> None:
        hook.factor = 3.0

    return hook, change


def _partials() -> Any:
    import functools

    return _replace_hook(
        functools.partial(_scaled, factor=2.0), functools.partial(_scaled, factor=3.0)
    )


_HOOK_CHANGES = {
    "lambda": lambda: _replace_hook(_LAMBDAS["double"], _LAMBDAS["triple"]),
    "partial": _partials,
    "closure": lambda: _replace_hook(_scaling_hook(2.0), _scaling_hook(3.0)),
    "object-attribute": _set_factor,
}


@pytest.mark.parametrize("how", list(_HOOK_CHANGES))
def test_a_hook_replaced_by_one_of_the_same_name_after_the_dataset_was_made_is_refused(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """serve9.5's watch compared a hook identity derived from its qualified name and file, so
    a lambda replaced by a lambda, a partial by one with other arguments, a factory's closure
    by one holding another value, or an attribute set on a hook object was accepted and the
    miss encoded with it under the old keys. The watch compares the hook objects and what
    they hold now."""
    import copy

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    first, change = _HOOK_CHANGES[how]()
    module = TinyConvEncoder().eval()
    handle = module.register_forward_pre_hook(first)
    original = copy.deepcopy(module)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))
    change(module, handle)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        ds[1]
    assert "\n" not in str(e.value)
    _served_as_it_was(audio_dir, tmp_path / "s", ds, original)


@pytest.mark.parametrize("how", ["partial", "closure", "lambda"])
def test_modules_whose_hooks_hold_other_values_have_their_own_keys(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """Two modules whose hooks differ only in what they hold (a partial's arguments, a
    closure's cell, a lambda's constant) shared their keys under serve9.5, each served the
    other's features: a hook's code, plain closure cells and a partial's arguments are keyed."""
    import functools

    from featbake.testing import TinyConvEncoder

    makers = {
        "partial": lambda f: functools.partial(_scaled, factor=f),
        "closure": _scaling_hook,
        "lambda": lambda f: _LAMBDAS["double" if f == 2.0 else "triple"],
    }
    a, b = TinyConvEncoder().eval(), TinyConvEncoder().eval()
    b.load_state_dict(a.state_dict())
    a.register_forward_pre_hook(makers[how](2.0))
    b.register_forward_pre_hook(makers[how](3.0))
    first = _fresh_dataset(audio_dir, a, tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    assert second.key(0) != first.key(0)
    torch.testing.assert_close(second[0], _live(b, second.path(0)))


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_a_module_whose_only_hooks_are_torchs_own_keeps_the_identity_it_had(norm: str) -> None:
    """serve9.5 keyed torch's own forward pre-hooks (the old-API ``weight_norm`` and
    ``spectral_norm`` of fairseq's wav2vec2 and HuBERT, EnCodec, DAC), so every store made
    from such a module missed; torch's code never enters a key (``code_identity``), and
    their effect is in the weights."""
    import warnings

    from featbake.encode.identity import module_identity
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # weight_norm's deprecation
        getattr(torch.nn.utils, norm)(module.conv2)
    module.eval()
    assert "\nhooks:" not in module_identity(module)


def test_a_hooks_source_file_edited_on_disk_is_no_change_of_a_moved_module(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve9.5 read and hashed a hook's source file at every exact check: a module that only
    moved was refused, as "a forward hook was added or removed", once the file was edited on
    disk (the hook running is the one loaded). The watch reads no file."""
    import importlib
    import sys

    folder = tmp_path / "pkg"
    folder.mkdir()
    source = folder / "serve9_review_hooks.py"
    source.write_text("def observe(module, args, out):\n    return None\n")
    monkeypatch.syspath_prepend(str(folder))
    hooks = importlib.import_module("serve9_review_hooks")
    try:
        from featbake.testing import TinyConvEncoder

        module = TinyConvEncoder().eval()
        module.register_forward_hook(hooks.observe)
        ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
        ds[0]
        source.write_text(source.read_text() + "# edited\n")
        module.share_memory()
        _users_forward(module)
        torch.testing.assert_close(ds[1], _live(module, ds.path(1)))
    finally:
        sys.modules.pop("serve9_review_hooks", None)


def test_a_refusal_in_a_spawned_worker_names_the_change_not_a_hook(
    spawned_misses: list[str],
) -> None:
    """In a spawned worker a hook of the script run reads as ``__mp_main__``'s, so serve9.5
    named any change of a hooked module "a forward hook was added or removed": what changed
    is told where the dataset was pickled, and carried (the last case of
    :data:`SPAWNED_MISSES`: a pre-hook of the script's, a plain attribute changed)."""
    out = [line for line in spawned_misses if line.startswith("hooked: ")]
    assert len(out) == 1, spawned_misses
    assert "changed since this dataset was created" in out[0]
    assert "forward hook" not in out[0]


def _device_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The watch's probe as it is for tensors on a GPU (``device_entry``), for CPU tensors
    too: the device path, run where there is no GPU."""
    import featbake.serve.cached_encoder as cached_encoder

    entry = cached_encoder.device_entry
    monkeypatch.setattr(
        cached_encoder, "_weight_probe", lambda ts: tuple(entry(t) if t.numel() else 0 for t in ts)
    )
    monkeypatch.setattr(cached_encoder, "crc32c_tensor", entry)


def _swap_two_channels(w: torch.Tensor, how: str) -> None:
    """Output channels 0 and 1 swapped: both rows' bytes kept, so are plain byte sums."""
    perm = torch.arange(w.shape[0])
    perm[[0, 1]] = perm[[1, 0]]
    with torch.no_grad():
        if how == "assign":
            w.data = w.data[perm].clone()
        else:
            w.copy_(w[perm].clone())


@pytest.mark.parametrize("how", ["assign", "in-place"])
def test_a_permuted_weight_on_a_device_is_a_change(
    tmp_path: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """serve9.1 keeps a weight whose pointer or version moved where its probe matches; on a
    device the probe was two byte sums, which a permutation of rows keeps (the code before
    hashed every weight again and refused). The device probe weighs each byte by its place."""
    import copy

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    _device_probe(monkeypatch)
    module = TinyConvEncoder().eval()
    original = copy.deepcopy(module)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    _swap_two_channels(module.conv2.weight, how)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[1]
    monkeypatch.undo()
    _served_as_it_was(audio_dir, tmp_path / "s", ds, original)


def _global_pre(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    from featbake.testing import TinyConvEncoder

    return (args[0] * 2.0,) if isinstance(module, TinyConvEncoder) else None


def _global_post(module: torch.nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    from featbake.testing import TinyConvEncoder

    return out * 2.0 if isinstance(module, TinyConvEncoder) else None


@pytest.mark.parametrize("kind", ["pre", "post"])
def test_a_global_forward_hook_added_after_the_dataset_was_made_is_refused(
    tmp_path: Path, audio_dir: Path, kind: str
) -> None:
    """torch's global forward hooks (``register_module_forward_pre_hook`` / ``_hook``) run on
    every module and were read by neither the key nor the watch: one added after the dataset
    was made encoded its misses under the old keys. The watch reads them: refused."""
    import copy

    from torch.nn.modules import module as torch_module

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    original = copy.deepcopy(module)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    add = (
        torch_module.register_module_forward_pre_hook
        if kind == "pre"
        else torch_module.register_module_forward_hook
    )
    handle = add(_global_pre if kind == "pre" else _global_post)
    try:
        _users_forward(module)
        with pytest.raises(EncoderLoadError, match="global forward hook") as e:
            ds[1]
        assert "\n" not in str(e.value)
    finally:
        handle.remove()
    _served_as_it_was(audio_dir, tmp_path / "s", ds, original)


class _TensorScale(torch.nn.Module):
    """TinyConvEncoder's output scaled by a tensor attribute that is no parameter or buffer."""

    def __init__(self) -> None:
        from featbake.testing import TinyConvEncoder

        super().__init__()
        self.inner = TinyConvEncoder()
        self.scale = torch.tensor(1.0)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.inner(wav) * self.scale


def _tensor_set(module: Any) -> None:
    module.scale = torch.tensor(2.0)


def _tensor_edited(module: Any) -> None:
    module.scale.mul_(2.0)


def _forward_set(module: Any) -> None:
    plain = type(module).forward
    module.forward = lambda wav: plain(module, wav) * 2.0


@pytest.mark.parametrize(
    "change",
    [_tensor_set, _tensor_edited, _forward_set],
    ids=["tensor-set", "tensor-in-place", "forward-set"],
)
def test_a_tensor_attribute_or_forward_changed_after_the_dataset_was_made_is_refused(
    tmp_path: Path, audio_dir: Path, change: Any
) -> None:
    """A public tensor attribute that is no parameter or buffer (set, or edited in place), or
    ``forward`` set on the instance (as accelerate's ``add_hook_to_module`` does), is in no
    key: changed after the dataset was made, the miss was stored under the old keys. The
    watch reads them (by id and version) and refuses a change of them, keys unchanged."""
    import copy

    from featbake.errors import EncoderLoadError

    module = _TensorScale().eval()
    original = copy.deepcopy(module)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    change(module)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="no parameter or buffer") as e:
        ds[1]
    assert "\n" not in str(e.value)
    _served_as_it_was(audio_dir, tmp_path / "s", ds, original)


def test_a_pickled_dataset_over_a_hooked_module_names_a_change_of_it_not_its_hooks(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A dataset pickled (as for a spawned worker) left the hooks it was given behind, so a
    change of its copy's module was named as "a forward hook was added": the copy reads its
    module's hooks where it lands."""
    import pickle

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_doubled_input)
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    copy = pickle.loads(pickle.dumps(ds))
    landed = copy._live.loaded.module  # the module the copy carries
    torch.testing.assert_close(copy[1], _live(landed, copy.path(1)))
    landed.conv2.dilation = (2,)
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created") as e:
        copy[2]
    assert "forward hook" not in str(e.value)


class _CallCounter:
    """A logging helper whose bound method is a forward pre-hook: it counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.calls += 1


def _counting_closure() -> Any:
    n = 0

    def pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        nonlocal n
        n += 1

    return pre


_COUNTING_HOOKS = {"bound-method": lambda: _CallCounter().pre, "closure": _counting_closure}


@pytest.mark.parametrize("how", list(_COUNTING_HOOKS))
def test_a_call_counting_hook_leaves_the_datasets_misses_served(
    tmp_path: Path, audio_dir: Path, how: str
) -> None:
    """serve9.9 keyed and watched what a hook holds, a counter its own code bumps too: the
    dataset's own second miss was refused as a hook change. What a hook's code writes itself
    (``self.calls += 1``, ``nonlocal n; n += 1``) is its bookkeeping, read by neither."""
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_COUNTING_HOOKS[how]())
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    _users_forward(module)
    torch.testing.assert_close(ds[1], _live(module, ds.path(1)))


@pytest.mark.parametrize("how", list(_COUNTING_HOOKS))
def test_a_call_counting_hooks_key_does_not_follow_its_count(how: str) -> None:
    """A process that ran the module once more before making its dataset found nothing
    stored: the counter was in the key."""
    from featbake.encode.identity import module_identity
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    module.register_forward_pre_hook(_COUNTING_HOOKS[how]())
    before = module_identity(module)
    with torch.no_grad():
        module(torch.zeros(1, 8000))
    assert module_identity(module) == before


def test_torchs_flop_counter_leaves_an_unchanged_modules_misses_served(
    tmp_path: Path, audio_dir: Path
) -> None:
    """torch's own global hooks (``FlopCounterMode``'s ``ModuleTracker``) were read as a
    change of global hooks: an unchanged module's miss made while counting FLOPs was refused.
    Global hooks of torch's code are left out, as torch's module hooks are."""
    from torch.utils.flop_counter import FlopCounterMode

    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    with FlopCounterMode(display=False):  # counting a training step's FLOPs
        served = ds[1]
    torch.testing.assert_close(served, _live(module, ds.path(1)))


def test_a_miss_after_a_global_hook_was_removed_is_served(tmp_path: Path, audio_dir: Path) -> None:
    """A refusal for a global hook was kept once the hook was gone (``unkeyed_change`` kept
    until trusted anew): the global-hook verdict follows the hooks as they are now."""
    from torch.nn.modules import module as torch_module

    from featbake.errors import EncoderLoadError
    from featbake.testing import TinyConvEncoder

    module = TinyConvEncoder().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    ds[0]
    handle = torch_module.register_module_forward_pre_hook(_global_pre)
    try:
        with pytest.raises(EncoderLoadError, match="global forward hook"):
            ds[1]
    finally:
        handle.remove()
    torch.testing.assert_close(ds[2], _live(module, ds.path(2)))


class _HookScaled(torch.nn.Module):
    """TinyConvEncoder whose input a pre-hook scales by a tensor its closure holds."""

    def __init__(self) -> None:
        from featbake.testing import TinyConvEncoder

        super().__init__()
        self.inner = TinyConvEncoder()
        scale = torch.tensor(1.0)
        self.scale_ref = [scale]  # not an attribute the watch reads (a list of tensors)
        self.inner.register_forward_pre_hook(lambda mod, args: (args[0] * scale,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_hook_holding_a_tensor_is_refused_when_the_dataset_is_made(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A hook's closure tensor was keyed by its type alone and not watched: edited in place
    (``scale.fill_(3.0)``) its outputs changed while key and watch did not, and two processes
    with other scales shared keys. Refused in one line, saying what to do."""
    from featbake.errors import EncoderLoadError

    with pytest.raises(EncoderLoadError, match=r"holds a value \(Tensor\).*buffer") as e:
        CachedFeatureDataset(audio_dir, _HookScaled().eval(), cache=tmp_path / "s")
    assert "\n" not in str(e.value)


class _OwnScaled(torch.nn.Module):
    """A hook closing over its own module and a bound method of it: what it holds is keyed."""

    def __init__(self) -> None:
        from featbake.testing import TinyConvEncoder

        super().__init__()
        self.inner = TinyConvEncoder()
        self.register_buffer("scale", torch.tensor(2.0))
        inner = self.inner
        self.inner.register_forward_pre_hook(lambda mod, args: (args[0] * self.scale,))
        self.register_forward_hook(lambda mod, args, out: inner.conv1 and out)
        self.inner.register_forward_pre_hook(self.pre)

    def pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_a_hook_holding_its_own_module_or_buffer_is_served(tmp_path: Path, audio_dir: Path) -> None:
    """The module itself, a submodule or a buffer held by a hook is read by the key."""
    module = _OwnScaled().eval()
    ds = _fresh_dataset(audio_dir, module, tmp_path / "s")
    torch.testing.assert_close(ds[0], _live(module, ds.path(0)))


# == round ten: what a forward hook holds, keyed by value or refused (serve10.*) ===================
# A hook's non-plain held values were keyed by type alone (serve9.13-serve9.15): hooks differing
# only there shared keys. Each test below failed on the code before round ten.


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


def test_a_hook_bound_to_another_modules_method_is_refused_for_the_first_dataset(
    tmp_path: Path, audio_dir: Path
) -> None:
    """Refused for the first dataset already, in one line naming the method's module: no key
    reads another module's weights, so no feature is stored under a key that misses them."""
    a = TinyConvEncoder().eval()
    a.register_forward_pre_hook(_Adapter(2.0).pre)
    with pytest.raises(EncoderLoadError, match="a method of the module _Adapter") as refused:
        CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.safetensors"))


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


def test_modules_whose_tensor_attributes_differ_are_served_their_own_features(
    tmp_path: Path, audio_dir: Path
) -> None:
    """Keyed by the tensor's value (serve10.6): neither dataset is refused, and the second is
    served its own features, not the first's."""
    a, b = _TensorScaled(2.0).eval(), _TensorScaled(3.0).eval()
    b.inner.load_state_dict(a.inner.state_dict())
    with pytest.warns(UserWarning, match="no featbake store"):
        first = CachedFeatureDataset(audio_dir, a, cache=tmp_path / "s")
    first[0]
    first.flush()
    second = CachedFeatureDataset(audio_dir, b, cache=tmp_path / "s")
    torch.testing.assert_close(second[0], _live(b, second.path(0)))
    assert not torch.allclose(second[0], first[0])


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


def test_a_listed_tensor_edited_in_place_after_the_dataset_was_made_is_refused(
    tmp_path: Path, audio_dir: Path
) -> None:
    """A tensor inside a module attribute's list is keyed by value (serve10.16); edited in
    place after the dataset was made (``mul_``), the next miss is refused in one line, as a
    tensor attribute's edit is (serve9.12), never stored under the old keys."""
    module = _ListScaled(2.0).eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=tmp_path / "s")
    ds[0]
    module.scales[0].mul_(2.0)
    _users_forward(module)
    with pytest.raises(EncoderLoadError, match="no parameter or buffer") as e:
        ds[1]
    assert "\n" not in str(e.value)


class _OffOnLong(TinyConvEncoder):
    """TinyConvEncoder, except that inputs over 1 s come out as NaN (``nan``) or times 1e6
    (``huge``: finite, past float16's 65504)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = super().forward(wav)
        if wav.shape[1] <= 16000:
            return out
        return out * float("nan") if self.how == "nan" else out * 1e6


@pytest.mark.parametrize(("how", "dtype"), [("huge", "float16"), ("nan", "float32")])
def test_a_miss_not_finite_as_stored_is_refused_never_served_or_written_back(
    tmp_path: Path, audio_dir: Path, how: str, dtype: str
) -> None:
    """A build refuses an item whose stored feature holds NaN or inf (float16's cast of values
    past its range too); a dataset's miss served it and wrote it back (a later build then
    reused it). Now the miss is refused in one line naming the item and the stored dtype, and
    nothing of it is kept; the finite items are served as the encoder gives them now."""
    from featbake.encode.sources import source_for
    from featbake.errors import EncodeError
    from featbake.recipe import Recipe

    module = _OffOnLong(how).eval()
    store = tmp_path / "store"
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(audio_dir, module, cache=store, dtype=dtype)
    torch_dtype = getattr(torch, dtype)
    refused = []
    for i in range(len(ds)):
        with torch.inference_mode():
            live = module(source_for(Recipe()).load(Path(ds.path(i))).unsqueeze(0))[0]
        if bool(torch.isfinite(live.to(torch_dtype)).all()):
            assert torch.equal(ds[i], live.to(torch_dtype))
            continue
        refused.append(i)
        with pytest.raises(EncodeError) as err:
            ds[i]
        text = str(err.value)
        assert text.startswith(f"{ds.path(i)}: the encoder returned NaN or infinite values")
        assert f"(stored as {dtype}); not served or stored" in text and "\n" not in text
    assert 0 < len(refused) < len(ds)
    ds.close()
    again = CachedFeatureDataset(audio_dir, module, cache=store, dtype=dtype, on_miss="error")
    assert again.stored() == len(ds) - len(refused)
    for i in refused:
        with pytest.raises(CacheMiss):
            again[i]


def test_a_miss_read_inside_the_callers_autocast_is_encoded_at_the_recipes_precision(
    tmp_path: Path, audio_dir: Path, encoder_file: Path
) -> None:
    """A training loop reading a dataset (``num_workers=0``) inside its own
    ``torch.autocast(bfloat16)``: the fp32 recipe's misses were encoded in bf16 and written
    back under the fp32 keys, and a later run served them as exact (about 0.4% off, far past
    float16's rounding). The recipe's precision is what runs, whatever the caller's context."""
    store = tmp_path / "store"
    ds = CachedFeatureDataset(audio_dir, encoder=encoder_file, cache=store)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = [ds[i] for i in range(len(ds))]
    ds.close()
    later = CachedFeatureDataset(audio_dir, encoder=encoder_file, cache=store, on_miss="error")
    for i in range(len(later)):
        want = live_features(encoder_file, Path(later.path(i)))
        torch.testing.assert_close(under[i], want)
        torch.testing.assert_close(later[i], want)
