"""The CUDA paths, run where a GPU is (skipped elsewhere; CI has none).

Each test compares what featbake gives on the GPU with the encoder run now (on the GPU, and on
the CPU where the kernels' rounding allows), never with the store alone: a ``--device cuda``
build (exact shapes, padded batches at bf16, a Hugging Face folder), ``DevicePrefetcher`` and
``FeatureLoader(device="cuda")`` batches, int8 rows dequantised on the GPU, a dataset's misses
encoded on the GPU, and ``CachedEncoder``'s device tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, StackDataset

from featbake import CachedEncoder, CachedFeatureDataset, FeatureLoader, build, pad_collate
from featbake.bake.batching import BatchingMode
from featbake.encode.encoders import EXACT_TOLERANCE, autocast_for, torchscript_quietly
from featbake.encode.sources import source_for
from featbake.quantize import Scheme, dequantize
from featbake.recipe import Recipe
from featbake.serve.collate import pinned_batches
from featbake.serve.prefetch import DevicePrefetcher, PinnedPool
from featbake.testing import LengthsEncoder, TinyConvEncoder, save_torchscript, write_audio_folder
from tests.helpers import rel_error, stored_features

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: cuDNN convolutions run in TF32 by default (10-bit mantissa), so a GPU run differs from the
#: CPU's fp32 by up to ~1e-3 relative; the GPU against itself is held to fp32's tolerance.
GPU_VS_CPU = 5e-3


def run_now(path: Path, wav: Path, device: str, recipe: Recipe | None = None) -> torch.Tensor:
    """The TorchScript encoder loaded afresh and run now on one preprocessed clip."""
    recipe = recipe or Recipe()
    with torchscript_quietly():
        module = torch.jit.load(str(path), map_location=device)
    x = source_for(recipe).load(wav).to(device)
    with torch.inference_mode(), autocast_for(torch.device(device), recipe.precision):
        out = module(x[None], torch.tensor([x.shape[-1]], device=device))
    feats, n = out if isinstance(out, tuple) else (out, None)
    feats = feats[0] if n is None else feats[0, : int(n[0])]
    return feats.to(recipe.torch_dtype).cpu()


def run_plain(path: Path, wav: Path, device: str) -> torch.Tensor:
    with torchscript_quietly():
        module = torch.jit.load(str(path), map_location=device)
    x = source_for(Recipe()).load(wav).to(device)
    with torch.inference_mode():
        return module(x[None])[0].cpu()


@pytest.fixture
def clips(tmp_path: Path) -> Path:
    root = tmp_path / "clips"
    write_audio_folder(root, 10, seconds=(0.3, 1.6), seed=7)
    return root


def test_a_cuda_build_stores_what_the_encoder_gives_on_the_gpu_now(
    tmp_path: Path, clips: Path
) -> None:
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt")
    report = build(clips, enc, cache=tmp_path / "s", device="cuda", workers=0)
    assert report.ok and report.encoded == 10
    stored = stored_features(tmp_path / "s", report.root)
    assert len(stored) == 10
    for rel, parts in stored.items():
        assert rel_error(parts[""], run_plain(enc, clips / rel, "cuda")) < 1e-5, rel
        assert rel_error(parts[""], run_plain(enc, clips / rel, "cpu")) < GPU_VS_CPU, rel
    again = build(clips, enc, cache=tmp_path / "s", device="cpu", workers=0)
    assert (again.encoded, again.reused) == (0, 10)  # one key on either device


def test_padded_bf16_batches_on_cuda_equal_each_clip_alone(tmp_path: Path, clips: Path) -> None:
    enc = save_torchscript(LengthsEncoder(), tmp_path / "lengths.pt")
    recipe = Recipe(precision="bf16")
    report = build(
        clips, enc, cache=tmp_path / "s", recipe=recipe, device="cuda", workers=0, batch_size=4,
        batching="padded",  # what is tested is padding on the GPU, not auto's timing of it
    )  # fmt: skip
    assert report.ok and report.encoded == 10
    assert report.batching == BatchingMode.PADDED, report.batching_note
    stored = stored_features(tmp_path / "s", report.root)
    worst_fp32 = 0.0
    for rel, parts in stored.items():
        want = run_now(enc, clips / rel, "cuda", recipe)
        assert rel_error(parts[""], want) <= EXACT_TOLERANCE["bf16"].relative, rel
        worst_fp32 = max(worst_fp32, rel_error(parts[""], run_now(enc, clips / rel, "cuda")))
    assert worst_fp32 > 1e-6  # bf16 really ran on the GPU


def test_a_hugging_face_folder_builds_padded_on_cuda_equal_to_transformers(
    tmp_path: Path, clips: Path
) -> None:
    pytest.importorskip("transformers")
    from tests.encode.test_hf import reference, save_model

    folder = save_model(tmp_path / "w2v")
    report = build(
        clips, folder, cache=tmp_path / "s", device="cuda", workers=0, batch_size=4,
        batching="padded",
    )  # fmt: skip
    assert report.ok and report.encoded == 10
    assert report.batching == BatchingMode.PADDED, report.batching_note
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        want = reference(folder, clips / rel).last_hidden_state[0]  # transformers, CPU, fp32
        assert rel_error(parts[""], want) < GPU_VS_CPU, rel


def test_device_prefetcher_and_feature_loader_hand_over_cuda_batches_equal_to_the_cpu_ones(
    tmp_path: Path, clips: Path
) -> None:
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt")
    build(clips, enc, cache=tmp_path / "s", workers=0)
    ds = CachedFeatureDataset(clips, enc, cache=tmp_path / "s", on_miss="error")
    cpu = list(DataLoader(ds, batch_size=4, collate_fn=pad_collate))
    prefetcher = DevicePrefetcher(DataLoader(ds, batch_size=4, collate_fn=pad_collate), "cuda")
    gpu = list(prefetcher)
    assert len(gpu) == len(cpu) == 3
    for (padded, lengths), want in zip(gpu, cpu, strict=True):
        assert padded.device.type == "cuda" and lengths.device.type == "cuda"
        assert torch.equal(padded.cpu(), want[0]) and torch.equal(lengths.cpu(), want[1])
    assert prefetcher.stats().tensors == 6
    labelled = StackDataset(ds, torch.arange(len(ds)))
    on_cpu = list(FeatureLoader(labelled, 4, seed=3))
    loader = FeatureLoader(labelled, 4, seed=3, device="cuda")
    on_gpu = list(loader)
    assert len(on_gpu) == len(on_cpu) == 3
    # one staging with DevicePrefetcher's: features built in its pinned pool and copied from
    # there, each batch's lengths and labels staged through it; every buffer given back
    assert loader.staging is not None and loader.staging.copied == 2 * 3
    assert loader.staging.pool.stats().lent == 0
    pool = PinnedPool()  # how FeatureLoader(device="cuda") reads: into its staging pool
    with pinned_batches(pool):
        built = ds.__getitems__([0, 1, 2]).padded
        assert built.is_pinned() and pool.lent(built)
    assert not ds.__getitems__([0, 1, 2]).padded.is_pinned()
    for (padded, lengths, idx), want in zip(on_gpu, on_cpu, strict=True):
        assert padded.device.type == "cuda" and idx.device.type == "cuda"
        assert torch.equal(padded.cpu(), want[0]) and torch.equal(idx.cpu(), want[2])
        for row, n, i in zip(padded.cpu(), lengths.cpu(), idx.cpu(), strict=True):
            live = run_plain(enc, Path(ds.path(int(i))), "cuda").to(torch.float16)
            assert rel_error(row[: int(n)], live) < 1e-3


def test_int8_rows_dequantised_on_the_gpu_equal_the_cpu_dequantised_rows(
    tmp_path: Path, clips: Path
) -> None:
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt")
    build(clips, enc, cache=tmp_path / "s", recipe=Recipe(dtype="int8"), workers=0)
    kw = {"cache": tmp_path / "s", "dtype": "int8", "on_miss": "error"}
    packed = CachedFeatureDataset(clips, enc, dequantize=False, **kw)
    served = CachedFeatureDataset(clips, enc, **kw)
    for i in range(len(packed)):
        on_gpu = dequantize(packed[i].to("cuda"), Scheme.INT8, torch.float16)
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.cpu(), served[i])
        live = run_plain(enc, Path(packed.path(i)), "cpu")
        assert rel_error(served[i], live) < 0.02  # int8's rounding


def test_a_dataset_encodes_its_misses_on_the_gpu_and_serves_them_after(
    tmp_path: Path, clips: Path
) -> None:
    enc = save_torchscript(TinyConvEncoder(), tmp_path / "enc.pt")
    ds = CachedFeatureDataset(clips, enc, cache=tmp_path / "s", device="cuda")
    assert ds.stored() == 0
    for i in range(len(ds)):
        assert rel_error(ds[i], run_plain(enc, Path(ds.path(i)), "cuda")) < 1e-5
    del ds
    again = CachedFeatureDataset(clips, enc, cache=tmp_path / "s", on_miss="error")
    assert again.stored() == 10


def test_cached_encoder_keeps_cuda_outputs_in_its_device_tier(tmp_path: Path) -> None:
    module = TinyConvEncoder().cuda().eval().requires_grad_(False)
    cached = CachedEncoder(module, cache=tmp_path / "s", device_cache="64MiB")
    x = torch.randn(3, 16000, device="cuda")
    ids = ["a", "b", "c"]
    with torch.inference_mode():
        want = module(x)
        first = cached(x, ids=ids)
        second = cached(x, ids=ids)
    assert first.device.type == "cuda" and second.device.type == "cuda"
    assert rel_error(first.cpu(), want.cpu()) < 1e-5
    assert torch.equal(first, second)
    assert cached.stats["encoded"] == 3 and cached.stats["hits_device"] == 3


def test_cached_encoder_device_tier_keeps_rows_of_its_own_not_the_callers_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device tier kept each row as a slice of the batch handed to the caller, so a
    caller's in-place edit of its batch (``out.mul_(...)``, a normalisation) was served by
    every later call, and one row held its whole batch in memory. The tier keeps rows of its
    own now: a miss's row copied once out of the encoder's batch, a row read from the store or
    RAM as it reached the device, with no copy on the device beyond that move."""
    module = TinyConvEncoder().cuda().eval().requires_grad_(False)
    x, ids = torch.randn(3, 16000, device="cuda"), ["a", "b", "c"]
    cached = CachedEncoder(module, cache=tmp_path / "s", device_cache="64MiB")
    with torch.inference_mode():
        want = module(x).cpu()
        cached(x, ids=ids).zero_()  # misses, then kept in the tier
        hits = cached(x, ids=ids)
        assert rel_error(hits.cpu(), want) < 1e-5
        hits.mul_(0)
        assert rel_error(cached(x, ids=ids).cpu(), want) < 1e-5
    assert cached.stats["hits_device"] == 6
    cached.flush()
    fresh = CachedEncoder(module, cache=tmp_path / "s", device_cache="64MiB")
    copies: list[torch.Size] = []
    clone = torch.Tensor.clone

    def counted(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if t.is_cuda:
            copies.append(t.shape)
        return clone(t, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "clone", counted)
    with torch.inference_mode():
        fresh(x, ids=ids).zero_()  # read from the store, moved to the device, kept there
    monkeypatch.undo()
    assert copies == [] and fresh.stats["hits_store"] == 3
    with torch.inference_mode():
        assert rel_error(fresh(x, ids=ids).cpu(), want) < 1e-5
    assert fresh.stats["hits_device"] == 3


def test_a_dataset_module_moved_to_the_gpu_after_the_dataset_was_made_encodes_there(
    tmp_path: Path, clips: Path
) -> None:
    """``.cuda()`` on a dataset's in-process module after the dataset was made: its misses
    sent their inputs to the CPU the module was on then, and failed with a device mismatch.
    They follow the module's weights now (a key names no device), and back on the CPU too."""
    module = TinyConvEncoder().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(clips, module, cache=tmp_path / "s")
    ds[0]
    for i, device in ((1, "cuda"), (2, "cuda"), (3, "cpu")):
        module.to(device)
        x = source_for(Recipe()).load(Path(ds.path(i))).to(device)
        with torch.inference_mode():
            want = module(x[None])[0].cpu()
        assert rel_error(ds[i].cpu(), want) < 1e-5


class _Counting(torch.nn.Module):
    """TinyConvEncoder's forward, counting its calls (its own bookkeeping)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TinyConvEncoder()
        self.calls = 0

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(wav)


def test_a_dataset_module_moved_to_the_gpu_and_run_there_keeps_its_keys(
    tmp_path: Path, clips: Path
) -> None:
    """serve9.1 on a GPU: a module counting its calls, moved with ``.cuda()`` after the dataset
    was made and run there by the user, had its next miss refused as a change. The tensors
    trusted on the CPU (their CRC) are compared by value on their host copy now; the misses
    are encoded on the GPU (followed at each batch, not only the first), and an edit after
    the move is still refused."""
    from featbake.errors import EncoderLoadError

    module = _Counting().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(clips, module, cache=tmp_path / "s")
    ds[0]
    module.cuda()
    with torch.no_grad():
        module(torch.zeros(1, 8000, device="cuda"))
    for i in (1, 2):
        x = source_for(Recipe()).load(Path(ds.path(i))).cuda()
        with torch.inference_mode():
            want = module(x[None])[0].cpu()
        assert rel_error(ds[i].cpu(), want) < 1e-5
    with torch.no_grad():
        module.inner.conv2.weight.data.mul_(2.0)
        module(torch.zeros(1, 8000, device="cuda"))
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[3]


class _FilterBank(torch.nn.Module):
    """A front-end whose only state is a buffer: frames of 160 samples on 8 fixed filters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(
            "bank", torch.randn(160, 8, generator=torch.Generator().manual_seed(3))
        )

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        frames = wav[:, : wav.shape[1] // 160 * 160].reshape(wav.shape[0], -1, 160)
        return frames @ self.bank


def test_a_front_end_of_buffers_only_on_the_gpu_stays_there_and_encodes_there(
    tmp_path: Path, clips: Path
) -> None:
    """serve9.3 on a GPU: a dataset given a front-end whose only state is a buffer, on the
    GPU, moved the user's module to the CPU (``from_module`` looked at parameters only). It
    stays on the GPU now, and its misses are encoded there; ``CachedEncoder`` serves its hits
    on the module's device too, as its misses are."""
    bank = _FilterBank().cuda().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(clips, bank, cache=tmp_path / "s")
    assert bank.bank.is_cuda
    x = source_for(Recipe()).load(Path(ds.path(0))).cuda()
    with torch.inference_mode():
        want = bank(x[None])[0].cpu()
    assert rel_error(ds[0].cpu(), want) < 1e-5 and bank.bank.is_cuda
    cached = CachedEncoder(bank, cache=tmp_path / "c")
    wav = torch.randn(2, 1600)
    first = cached(wav.cuda(), ids=["a", "b"])
    again = cached(wav, ids=["a", "b"])  # hits, the input on the CPU
    assert first.device == again.device == bank.bank.device


def test_a_permuted_weight_of_a_module_on_the_gpu_is_a_change(tmp_path: Path, clips: Path) -> None:
    """serve9.1's comparison by value on a GPU: a weight trusted there (its device probe) and
    replaced by its rows permuted (two output channels swapped) kept both byte sums, and its
    miss was encoded under the old keys. The device probe weighs each byte by its place."""
    from featbake.errors import EncoderLoadError

    module = TinyConvEncoder().cuda().eval()
    with pytest.warns(UserWarning, match="no featbake store"):
        ds = CachedFeatureDataset(clips, module, cache=tmp_path / "s")
    ds[0]
    w = module.conv2.weight
    perm = torch.arange(w.shape[0], device="cuda")
    perm[[0, 1]] = perm[[1, 0]]
    with torch.no_grad():
        w.data = w.data[perm].clone()
    with pytest.raises(EncoderLoadError, match="changed since this dataset was created"):
        ds[1]
