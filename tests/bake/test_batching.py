"""Padded length-sorted batches: the pure planner, the lengths protocol, the exactness guard.

Features are checked against running the encoder on each input alone now, never against the
store itself; the guard's fall-back is driven by a real encoder that leaks padding.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from featbake.bake import batching
from featbake.bake.batching import (
    DECIDE_AFTER,
    FEWER_BY,
    FIRST_CHECKED,
    PAD_STEPS,
    SLOWER_BY,
    WARMUP_BATCHES,
    BatchingMode,
    BatchRunner,
    GuardChoice,
    LengthBatcher,
    Pace,
    PaceTally,
    Padding,
    PadLengths,
    budget_samples,
    pad_lengths_for,
    plan_by_length,
    stepped_length,
)
from featbake.bake.pipeline import build
from featbake.encode.encoders import (
    EXACT_TOLERANCE,
    accepts_lengths,
    autocast_for,
    from_module,
    pad_inputs,
    relative_error,
    torchscript_quietly,
)
from featbake.encode.loaders import load_encoder
from featbake.encode.outputs import encode_batch, encode_padded
from featbake.encode.sources import source_for
from featbake.errors import CacheMiss, ConfigError, EncodeError
from featbake.progress import Progress
from featbake.quantize import Scheme, dequantize, quantize
from featbake.recipe import Recipe
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.layout import Layout
from featbake.store.merge import merge
from featbake.testing import LengthsEncoder, save_torchscript, write_audio_folder
from tests.conftest import invoke
from tests.helpers import assert_store_consistent, rel_error, root_keys, stored_features


# -- the planner (pure) ---------------------------------------------------------------------------
def check_plan(
    lengths: list[int], plan: list[list[int]], batch_size: int, budget: int, pad_to=int
) -> None:
    flat = [i for batch in plan for i in batch]
    assert sorted(flat) == list(range(len(lengths)))  # every item exactly once
    assert flat == sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # length order
    for n, batch in enumerate(plan):
        assert 1 <= len(batch) <= batch_size
        cost = len(batch) * pad_to(max(lengths[i] for i in batch))
        assert cost <= budget or len(batch) == 1  # over budget only alone
        if n + 1 < len(plan):  # greedy: the next item would not have fitted
            nxt = plan[n + 1][0]
            assert len(batch) == batch_size or pad_to(lengths[nxt]) * (len(batch) + 1) > budget


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 500), max_size=60),
    st.integers(1, 9),
    st.integers(1, 2000),
)
def test_plan_by_length_against_its_rules(lengths: list[int], batch_size: int, budget: int) -> None:
    check_plan(lengths, plan_by_length(lengths, batch_size, budget), batch_size, budget)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 5000), max_size=60),
    st.integers(1, 9),
    st.integers(1, 20000),
)
def test_a_plan_padded_to_stepped_lengths_keeps_its_budget(
    lengths: list[int], batch_size: int, budget: int
) -> None:
    plan = plan_by_length(lengths, batch_size, budget, stepped_length)
    check_plan(lengths, plan, batch_size, budget, stepped_length)


def test_plan_by_length_small_cases_exhaustively() -> None:
    import itertools

    for n in range(5):
        for lengths in itertools.product([1, 2, 3, 7], repeat=n):
            for batch_size in (1, 2, 3):
                for budget in (1, 4, 6, 9, 100):
                    plan = plan_by_length(list(lengths), batch_size, budget)
                    check_plan(list(lengths), plan, batch_size, budget)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 400), max_size=120), st.integers(1, 6), st.integers(50, 3000))
def test_length_batcher_releases_every_item_once_with_bounded_memory(
    lengths: list[int], batch_size: int, budget: int
) -> None:
    batcher = LengthBatcher(batch_size, budget)
    seen: list[int] = []
    for i, n in enumerate(lengths):
        for batch in batcher.add(n, i):
            seen.extend(batch)
            assert len(batch) <= batch_size
            assert len(batch) == 1 or len(batch) * max(lengths[j] for j in batch) <= budget
        assert batcher.pending <= batcher.pool_items
    for batch in batcher.flush():
        seen.extend(batch)
    assert sorted(seen) == list(range(len(lengths)))
    assert batcher.pending == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4000), max_size=120), st.integers(1, 6), st.integers(50, 30000))
def test_a_length_batcher_padding_to_stepped_lengths_keeps_its_budget(
    lengths: list[int], batch_size: int, budget: int
) -> None:
    batcher = LengthBatcher(batch_size, budget, pad_to=stepped_length)
    seen: list[int] = []
    for batch in [b for i, n in enumerate(lengths) for b in batcher.add(n, i)] + batcher.flush():
        seen.extend(batch)
        longest = stepped_length(max(lengths[j] for j in batch))
        assert len(batch) == 1 or len(batch) * longest <= budget
    assert sorted(seen) == list(range(len(lengths)))


# -- stepped padded lengths (pure) -------------------------------------------------------------
def test_stepped_lengths_exhaustively() -> None:
    """Every length up to 2**15: at least the longest, under 1/PAD_STEPS more, the same for a
    stepped length, never less for a longer one, and PAD_STEPS lengths an octave."""
    previous = 0
    for n in range(1, 2**15 + 1):
        padded = stepped_length(n)
        assert n <= padded < n + n / PAD_STEPS or padded == n, n
        assert stepped_length(padded) == padded and padded >= previous, n
        previous = padded
    for e in range(4, 15):  # the top of an octave steps to the next one's first length
        octave = {stepped_length(n) for n in range(2**e, 2 ** (e + 1))}
        assert len(octave - {2 ** (e + 1)}) == PAD_STEPS, e
    assert stepped_length(16000) == 16384 and stepped_length(16001) == 16384


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2**40))
def test_stepped_lengths_of_long_inputs(n: int) -> None:
    padded = stepped_length(n)
    assert n <= padded < n * (1 + 1 / PAD_STEPS) or padded == n
    assert stepped_length(padded) == padded


def test_padded_lengths_step_for_audio_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pad_lengths_for("cuda") is PadLengths.STEPPED
    assert pad_lengths_for("cpu") is PadLengths.EXACT
    assert pad_lengths_for("cuda", "text") is PadLengths.EXACT  # CLIP ends at 77 positions
    monkeypatch.setattr(batching, "PAD_LENGTHS", PadLengths.STEPPED)
    assert pad_lengths_for("cpu") is PadLengths.STEPPED
    assert pad_lengths_for("cpu", "npy") is PadLengths.EXACT


# -- the guard's choice of batches (pure) ---------------------------------------------------------
def naive_wants(checked: list[Padding], padding: Padding, first: int) -> bool:
    """The rule as written: the first batches, then padding unlike any checked."""
    if len(checked) < first or not checked:
        return True
    return (
        padding.padded_to not in {c.padded_to for c in checked}
        or padding.samples > max(c.samples for c in checked)
        or padding.fraction > max(c.fraction for c in checked)
        or padding.samples * FEWER_BY < min(c.samples for c in checked)
    )


paddings = st.builds(  # few padded lengths, as stepped lengths recur
    lambda length, share: Padding(length * share // 100, length),
    st.sampled_from([8000, 12000, 16000, 24000]),
    st.integers(0, 90),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(paddings, max_size=40), st.integers(0, 4))
def test_guard_choice_against_the_rule(batches: list[Padding], first: int) -> None:
    choice, checked = GuardChoice(first=first), []
    for padding in batches:
        wants = choice.wants(padding)
        assert wants == naive_wants(checked, padding, first)
        if wants:
            choice.add(padding)
            checked.append(padding)
        else:  # what it skips, checked batches covered: its length, no more padded, not much less
            assert padding.padded_to in {c.padded_to for c in checked}
            assert padding.samples <= max(c.samples for c in checked)
            assert padding.fraction <= max(c.fraction for c in checked)
            assert padding.samples * FEWER_BY >= min(c.samples for c in checked)
    assert choice.checked == len(checked) >= min(first, len(batches))


def test_the_guard_checks_few_of_many_batches_padded_alike() -> None:
    """1024 clips of 1-20 s in batches of 16 (the GPU bench's shape): the guard's runs stop
    growing with the batches (main checked all 94)."""
    import random

    gen, rate = random.Random(3), 16000
    batcher = LengthBatcher(16, 160 * rate, pad_to=stepped_length)
    lengths = [int(gen.uniform(1, 20) * rate) for _ in range(1024)]
    plan = [b for n in lengths for b in batcher.add(n, n)] + batcher.flush()
    choice = GuardChoice()
    wanted = 0
    for batch in plan:
        padding = Padding.of(batch, stepped_length(max(batch)))
        if choice.wants(padding):
            wanted += 1
            choice.add(padding)
    assert len(plan) > 90 and FIRST_CHECKED <= wanted <= 25  # a check per length, few more
    assert len({stepped_length(max(b)) for b in plan}) <= 4.5 * PAD_STEPS  # 16000..320000


def test_a_three_hour_file_is_released_alone_at_once() -> None:
    rate = 16000
    batcher = LengthBatcher(16, budget=160 * rate)
    assert batcher.add(5 * rate, "short") == []
    three_hours = 3 * 3600 * rate
    ready = batcher.add(three_hours, "long")
    assert ["long"] in ready  # not held, not padded with anything
    assert batcher.pending <= 1  # at most the short clip waits


def test_budget_from_seconds_or_samples() -> None:
    assert budget_samples(Recipe(sample_rate=8000), 2.0, None) == 16000
    assert budget_samples(Recipe(), None, 1234) == 1234
    with pytest.raises(ConfigError, match="batch-seconds"):
        budget_samples(Recipe(), -1.0, None)


# -- the lengths protocol ----------------------------------------------------------------------
def test_pad_inputs_zero_pads_on_the_right() -> None:
    batch = pad_inputs([torch.ones(3), torch.ones(5)])
    assert batch.lengths.tolist() == [3, 5]
    assert batch.inputs.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]


def test_accepts_lengths_by_the_argument_name(tmp_path: Path) -> None:
    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return x

    assert accepts_lengths(LengthsEncoder())
    assert not accepts_lengths(Masked())
    with torchscript_quietly():
        scripted = torch.jit.load(str(save_torchscript(LengthsEncoder(), tmp_path / "l.pt")))
    assert accepts_lengths(scripted)


def test_a_pt2_export_with_lengths_takes_them(tmp_path: Path) -> None:
    auto = torch.export.Dim.AUTO
    program = torch.export.export(
        LengthsEncoder().eval(),
        (torch.randn(2, 16000), torch.tensor([16000, 9000])),
        dynamic_shapes={"wav": {0: auto, 1: auto}, "lengths": {0: auto}},
    )
    torch.export.save(program, tmp_path / "l.pt2")
    enc = load_encoder(tmp_path / "l.pt2")
    assert enc.takes_lengths
    xs = [torch.randn(n) for n in (9000, 4000)]
    for x, got in zip(xs, encode_padded(enc, xs, Recipe()), strict=True):
        alone = LengthsEncoder().eval()(x[None], torch.tensor([len(x)]))[0][0]
        assert rel_error(got[""], alone.detach()) < 1e-4


def test_an_encoder_breaking_the_protocol_is_an_encode_error() -> None:
    class NoPair(nn.Module):
        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            return x.unsqueeze(-1)

    enc = from_module(NoPair())
    with pytest.raises(EncodeError, match=r"\(features, out_lengths\)"):
        encode_padded(enc, [torch.ones(4), torch.ones(2)], Recipe())


# -- builds ------------------------------------------------------------------------------------
@pytest.fixture
def varied_audio(tmp_path: Path) -> Path:
    root = tmp_path / "varied"
    write_audio_folder(root, 14, seconds=(0.3, 2.0), seed=5)
    return root


@pytest.fixture
def lengths_encoder_file(tmp_path: Path) -> Path:
    return save_torchscript(LengthsEncoder(), tmp_path / "lengths.pt")


def alone(module: nn.Module, path: Path, recipe: Recipe) -> torch.Tensor:
    """The encoder run now on one preprocessed file, alone, trimmed to its output length."""
    x = source_for(recipe).load(path)
    with torch.inference_mode(), autocast_for(torch.device("cpu"), recipe.precision):
        feats, out_len = module(x[None], torch.tensor([x.shape[-1]]))
    return feats[0, : int(out_len[0])].to(recipe.torch_dtype)


def test_a_torchscript_lengths_encoder_batches_padded_and_equals_runs_alone(
    tmp_path: Path, lengths_encoder_file: Path, varied_audio: Path
) -> None:
    report = build(varied_audio, lengths_encoder_file, cache=tmp_path / "s", workers=0)
    assert report.ok and report.encoded == 14
    assert report.batching == BatchingMode.PADDED
    assert "checked" in report.batching_note
    with torchscript_quietly():
        module = torch.jit.load(str(lengths_encoder_file))
    stored = stored_features(tmp_path / "s", report.root)
    assert len(stored) == 14
    for rel, parts in stored.items():
        assert rel_error(parts[""], alone(module, varied_audio / rel, Recipe())) < 1e-4


def test_padded_batches_call_the_encoder_fewer_times(tmp_path: Path, varied_audio: Path) -> None:
    calls: list[int] = []
    module = LengthsEncoder()
    module.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    report = build(varied_audio, module, cache=tmp_path / "s", workers=0, batch_size=8)
    assert report.batching == BatchingMode.PADDED
    padded_batches = [n for n in calls if n > 1]
    guard_reruns = len(padded_batches)  # the most padded item of every padded batch, alone
    assert padded_batches and calls.count(1) <= guard_reruns + 1  # (+1: a batch of one item)
    assert len(calls) <= 14 // 8 + 1 + guard_reruns + 1
    assert sum(calls) == 14 + guard_reruns


def test_keys_do_not_depend_on_the_batching_mode(
    tmp_path: Path, lengths_encoder_file: Path, varied_audio: Path
) -> None:
    padded = build(varied_audio, lengths_encoder_file, cache=tmp_path / "a", workers=0)
    exact = build(
        varied_audio, lengths_encoder_file, cache=tmp_path / "b", workers=0, batching="exact"
    )
    assert exact.batching == BatchingMode.EXACT and padded.batching == BatchingMode.PADDED
    assert root_keys(tmp_path / "a", padded.root) == root_keys(tmp_path / "b", exact.root)
    again = build(
        varied_audio, lengths_encoder_file, cache=tmp_path / "a", workers=0, batching="exact"
    )
    assert again.encoded == 0 and again.reused == 14
    a = stored_features(tmp_path / "a", padded.root)
    b = stored_features(tmp_path / "b", exact.root)
    for rel in a:
        assert rel_error(a[rel][""], b[rel][""]) < 1e-4


class LeakyLengthsEncoder(nn.Module):
    """Takes lengths but normalises over the whole padded input: padding changes its output."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LengthsEncoder()

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        wav = (wav - wav.mean(dim=-1, keepdim=True)) / (wav.std(dim=-1, keepdim=True) + 1e-5)
        return self.inner(wav, lengths)


@pytest.fixture(params=[PadLengths.EXACT, PadLengths.STEPPED], ids=["exact", "stepped"])
def pad_lengths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> PadLengths:
    """Padded lengths exact (the CPU's) and stepped (a GPU's), both run here on the CPU."""
    monkeypatch.setattr(batching, "PAD_LENGTHS", request.param)
    return request.param


def test_the_guard_falls_back_to_exact_shapes_when_padding_leaks(
    tmp_path: Path, varied_audio: Path, pad_lengths: PadLengths
) -> None:
    path = save_torchscript(LeakyLengthsEncoder(), tmp_path / "leaky.pt")
    report = build(varied_audio, path, cache=tmp_path / "s", workers=0, batch_size=8)
    assert report.ok and report.encoded == 14
    assert report.batching == BatchingMode.EXACT
    assert "not exact" in report.batching_note and "fp32" in report.batching_note
    with torchscript_quietly():
        module = torch.jit.load(str(path))
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        # Nothing inexact was stored, also from the batch that tripped the guard.
        assert rel_error(parts[""], alone(module, varied_audio / rel, Recipe())) < 1e-4


class LeakyNanEncoder(nn.Module):
    """LeakyLengthsEncoder with its first value NaN (a log of a silent frame, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.leaky = LeakyLengthsEncoder()

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_lengths = self.leaky(wav, lengths)
        feats = feats.clone()
        feats[:, 0, 0] = float("nan")
        return feats, out_lengths


def test_a_nan_in_the_output_never_lets_a_padding_leak_pass_the_guard(tmp_path: Path) -> None:
    """The guard's error was NaN when the item run alone held a NaN, and ``NaN > tolerance`` is
    False: an --allow-nonfinite build stored every padded item with the padding's leak. Now a
    NaN at the same place in both counts equal, and the leak elsewhere trips the guard."""
    nan = torch.tensor([1.0, float("nan")])
    assert relative_error(nan.clone(), nan) == 0.0
    assert relative_error(torch.full((2,), 99.0), nan) == float("inf")
    assert relative_error(torch.tensor([1.5, float("nan")]), nan) == 0.5
    data = tmp_path / "varied"
    write_audio_folder(data, 14, seconds=(0.3, 2.0), seed=5)
    path = save_torchscript(LeakyNanEncoder(), tmp_path / "leaky_nan.pt")
    report = build(data, path, cache=tmp_path / "s", workers=0, batch_size=8, allow_nonfinite=True)
    assert report.ok and report.encoded == 14
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    with torchscript_quietly():
        module = torch.jit.load(str(path))
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        want = alone(module, data / rel, Recipe())
        torch.testing.assert_close(parts[""], want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_batch_runner_moves_waiting_items_to_exact_shapes_on_fall_back() -> None:
    enc = from_module(LeakyLengthsEncoder())
    runner = BatchRunner(enc, Recipe(), "auto", batch_size=2, budget=10**9)
    xs = [torch.randn(n) for n in (8000, 3000, 5000, 5000, 7000)]
    ready: list[list[int]] = []
    for i, x in enumerate(xs):
        ready += runner.add(tuple(x.shape), i)
    results = {}
    for batch in ready + runner.flush():
        for i, parts in zip(batch, runner.encode([xs[i] for i in batch]), strict=True):
            results[i] = parts
    assert runner.mode is BatchingMode.EXACT
    assert sorted(results) == list(range(5))
    for i, x in enumerate(xs):
        assert rel_error(results[i][""], encode_batch(enc, [x], Recipe())[0][""]) < 1e-4


def test_padded_is_refused_for_an_encoder_without_lengths(
    tmp_path: Path, encoder_file: Path, varied_audio: Path
) -> None:
    with pytest.raises(ConfigError, match="takes lengths"):
        build(varied_audio, encoder_file, cache=tmp_path / "s", workers=0, batching="padded")
    report = build(varied_audio, encoder_file, cache=tmp_path / "s", workers=0)
    assert report.batching == BatchingMode.EXACT and "takes no lengths" in report.batching_note


def test_precision_is_in_the_key_and_bf16_matches_autocast_runs(
    tmp_path: Path, lengths_encoder_file: Path, varied_audio: Path
) -> None:
    recipe = Recipe(precision="bf16")
    report = build(varied_audio, lengths_encoder_file, cache=tmp_path / "s", recipe=recipe)
    assert report.recipe_fp != Recipe().fingerprint()
    assert report.batching == BatchingMode.PADDED, report.batching_note
    with torchscript_quietly():
        module = torch.jit.load(str(lengths_encoder_file))
    fp32 = {}
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        want = alone(module, varied_audio / rel, recipe)
        assert rel_error(parts[""], want) <= EXACT_TOLERANCE["bf16"].relative
        fp32[rel] = rel_error(parts[""], alone(module, varied_audio / rel, Recipe()))
    assert max(fp32.values()) > 1e-6  # bf16 really ran: it is not the fp32 output


def test_scripted_encoders_autocast_through_the_dispatcher_and_the_jit_setting_is_restored(
    lengths_encoder_file: Path,
) -> None:
    """TorchScript's own autocast pass crashed a scripted transformer under CUDA autocast (an
    H200, torch 2.11): autocast_for turns it off for the call; the dispatcher's autocast then
    gives the same bf16 outputs, and the process's setting is back afterwards."""
    with torchscript_quietly():
        module = torch.jit.load(str(lengths_encoder_file))
    x, lengths = torch.randn(2, 9000), torch.tensor([9000, 6000])
    with torch.inference_mode():
        fp32 = module(x, lengths)[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the JIT's own pass
            jit_pass = module(x, lengths)[0]
        with autocast_for(torch.device("cpu"), "bf16"):
            assert torch._C._jit_set_autocast_mode(False) is False  # off inside
            ours = module(x, lengths)[0]
    assert torch._C._jit_set_autocast_mode(True) is True  # restored
    assert ours.dtype == jit_pass.dtype == torch.bfloat16
    assert torch.equal(ours, jit_pass) and rel_error(ours.float(), fp32) > 1e-6


def test_cli_build_reports_the_batching_mode(
    tmp_path: Path, lengths_encoder_file: Path, varied_audio: Path
) -> None:
    args = ["build", "-e", lengths_encoder_file, "-d", varied_audio, "--cache", tmp_path / "s"]
    res = invoke(*args, "--json", "--batch-seconds", "3", "--workers", "0")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # auto: padded, unless padding was timed slower here
    assert report["batching"] in ("padded", "exact") and report["encoded"] == 14
    assert ("padded length-sorted" if report["batching"] == "padded" else "time per input") in (
        report["batching_note"]
    )
    # A rebuild batches nothing (and says nothing of batching): each mode into a new store.
    res = invoke(
        *args[:-1], tmp_path / "p", "--json", "--batch-seconds", "3", "--batching", "padded"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["batching"] == "padded"
    res = invoke(*args[:-1], tmp_path / "e", "--batching", "exact")
    assert res.returncode == 0, res.stderr
    assert "exact-shape batching (--batching exact)" in res.stdout
    res = invoke(*args, "--precision", "fp8")
    assert res.returncode != 0 and "precision" in res.stderr and "Traceback" not in res.stderr


# -- import-path factories for torchaudio and s3prl, against stand-ins -------------------------
class StandInWav2Vec2(nn.Module):
    """torchaudio.models.Wav2Vec2Model's documented API: forward and extract_features."""

    def __init__(self, layers: int = 10) -> None:
        super().__init__()
        self.inner = LengthsEncoder(dim=16, layers=layers)
        self.num_layers_asked: list[int | None] = []

    def extract_features(
        self, waveforms: torch.Tensor, lengths: torch.Tensor | None = None, num_layers=None
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        self.num_layers_asked.append(num_layers)
        if lengths is None:
            lengths = torch.full((waveforms.shape[0],), waveforms.shape[-1])
        inner = self.inner
        x = torch.nn.functional.gelu(inner.conv(waveforms.unsqueeze(1))).transpose(1, 2)
        out_lengths = torch.div(lengths - inner.kernel, inner.hop, rounding_mode="floor") + 1
        mask = torch.arange(x.shape[1])[None, :] >= out_lengths[:, None]
        feats = []
        for layer in inner.body.layers[:num_layers]:
            x = layer(x, src_key_padding_mask=mask)
            feats.append(x)
        return feats, out_lengths

    def forward(
        self, waveforms: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_lengths = self.extract_features(waveforms, lengths)
        return feats[-1], out_lengths


class StandInUpstream(nn.Module):
    """s3prl.nn.S3PRLUpstream's documented API: (wavs, wavs_len) -> (all_hs, all_hs_len)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model = StandInWav2Vec2(layers=3)

    def forward(self, wavs: torch.Tensor, wavs_len: torch.Tensor) -> tuple[list, list]:
        feats, out_lengths = self.model.extract_features(wavs, wavs_len)
        return [feats[0] * 0 + 1, *feats], [out_lengths] * (len(feats) + 1)


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    torchaudio = types.ModuleType("torchaudio")
    torchaudio.models = types.SimpleNamespace(  # type: ignore[attr-defined]
        wav2vec2_base=StandInWav2Vec2, wavlm_base=StandInWav2Vec2
    )
    s3prl, s3prl_nn = types.ModuleType("s3prl"), types.ModuleType("s3prl.nn")
    s3prl_nn.S3PRLUpstream = StandInUpstream  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchaudio", torchaudio)
    monkeypatch.setitem(sys.modules, "s3prl", s3prl)
    monkeypatch.setitem(sys.modules, "s3prl.nn", s3prl_nn)


def per_clip_parts(module: nn.Module, path: Path) -> dict[str, torch.Tensor]:
    x = source_for(Recipe()).load(path)
    with torch.inference_mode():
        feats, out_len = module(x[None], torch.tensor([x.shape[-1]]))
    if isinstance(feats, torch.Tensor):
        feats = {"": feats}
    return {k: v[0, : int(out_len[0])] for k, v in feats.items()}


@pytest.mark.parametrize(
    ("factory", "parts"),
    [
        ("examples.encoders_torchaudio:wav2vec2_base", {""}),
        ("examples.encoders_torchaudio:wav2vec2_base_layers_3_6_9", {"layer3", "layer6", "layer9"}),
        ("examples.encoders_s3prl:hubert_base", {"layer0", "layer1", "layer2", "layer3"}),
    ],
)
def test_example_factories_follow_the_lengths_protocol(
    tmp_path: Path, varied_audio: Path, stand_ins: None, factory: str, parts: set[str]
) -> None:
    enc = load_encoder(factory)
    assert enc.takes_lengths
    report = build(varied_audio, enc, cache=tmp_path / "s", workers=0, batch_size=8)
    assert report.ok and report.batching == BatchingMode.PADDED, report.batching_note
    for rel, stored in stored_features(tmp_path / "s", report.root).items():
        want = per_clip_parts(enc.module, varied_audio / rel)
        assert set(stored) == parts == set(want)
        for part in parts:
            assert rel_error(stored[part], want[part]) < 1e-4
    if factory.endswith("layers_3_6_9"):  # the model was told to stop after layer 9 of 10
        assert set(enc.module.model.num_layers_asked) == {9}


class LatePaddingLeak(nn.Module):
    """Exact until an item is padded by more than ``threshold`` samples, then its output drifts.

    Like an encoder whose masking breaks down only for long padding (a positional bucket, a
    convolution's receptive field): the first, short batches pad little and pass any check.
    """

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.inner = LengthsEncoder()
        self.threshold = threshold

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_len = self.inner(wav, lengths)
        padding = wav.shape[-1] - lengths
        leak = (padding > self.threshold).to(feats.dtype) * 0.5
        return feats + leak[:, None, None], out_len


def write_clips(folder: Path, seconds: list[float], rate: int = 16000) -> None:
    import soundfile

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(7)
    for i, sec in enumerate(seconds):
        wav = torch.randn(int(sec * rate), generator=gen) * 0.1
        soundfile.write(folder / f"clip{i:02d}.wav", wav.numpy(), rate)


def test_every_padded_batch_is_checked_so_a_late_padding_leak_stores_nothing_wrong(
    tmp_path: Path, pad_lengths: PadLengths
) -> None:
    """Issue 16 item 1: the guard sampled the first two batches only. Here padding leaks only
    past 1 s of padding, which only the third (longest) batch reaches: every stored feature
    must still equal the encoder run on that item alone, the batches sealed before the
    fall-back included, and the build says it fell back."""
    # Batches of 4 in length order: two tight batches (<= 0.03 s of padding), then one with 2 s.
    seconds = [0.50, 0.51, 0.52, 0.53, 0.80, 0.81, 0.82, 0.83, 1.0, 1.0, 1.01, 3.0]
    write_clips(tmp_path / "clips", seconds)
    module = LatePaddingLeak(threshold=16000)
    calls: list[int] = []
    module.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    report = build(tmp_path / "clips", module, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == len(seconds)
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    assert calls[:4] == [4, 1, 4, 1]  # two padded batches, each checked, before the leak
    plain = LatePaddingLeak(threshold=16000)
    plain.load_state_dict(module.state_dict())
    recipe = Recipe()
    stored = stored_features(tmp_path / "s", report.root)
    assert len(stored) == len(seconds)
    for rel, parts in stored.items():
        assert rel_error(parts[""], alone(plain, tmp_path / "clips" / rel, recipe)) < 1e-4, rel


def test_the_note_says_what_the_guard_checked(tmp_path: Path, varied_audio: Path) -> None:
    report = build(
        varied_audio, LengthsEncoder(), cache=tmp_path / "s", workers=0, batch_size=4,
        batching="padded",  # auto may time padding slower on this CPU and go exact
    )  # fmt: skip
    assert report.batching == BatchingMode.PADDED
    note = report.batching_note
    assert "4 batches padded to 4 lengths; 4 checked, the first 3" in note, note
    assert "stepped" not in note  # on the CPU padded lengths stay exact


# -- stepped padded lengths and the guard's choice, in builds --------------------------------------
def record_calls(module: nn.Module) -> list[tuple[int, int]]:
    """(rows, padded length) of every call of ``module``."""
    calls: list[tuple[int, int]] = []
    module.register_forward_hook(lambda _m, args, _out: calls.append(tuple(args[0].shape)))
    return calls


def assert_stores_each_clip_alone(store: Path, root: str, clips: Path, module: nn.Module) -> None:
    stored = stored_features(store, root)
    assert stored
    for rel, parts in stored.items():
        assert rel_error(parts[""], alone(module, clips / rel, Recipe())) < 1e-4, rel


def test_stepped_padded_lengths_recur_and_store_each_clip_as_run_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 5: on a GPU a new length's first call costs ~55 ms, and batches padded to
    their longest clip ran a new length nearly every time. Stepped (as on a GPU, forced here on
    the CPU), 40 clips of 1-1.4 s in batches of 4 run at most 5 padded lengths (exact: 10)."""
    monkeypatch.setattr(batching, "PAD_LENGTHS", PadLengths.STEPPED)
    gen = torch.Generator().manual_seed(11)
    write_clips(tmp_path / "clips", [1.0 + 0.4 * float(u) for u in torch.rand(40, generator=gen)])
    module = LengthsEncoder()
    calls = record_calls(module)
    report = build(tmp_path / "clips", module, cache=tmp_path / "s", workers=0, batch_size=4,
                   batching="padded")  # fmt: skip
    assert report.ok and report.encoded == 40 and report.batching == BatchingMode.PADDED
    padded = [length for rows, length in calls if rows > 1]
    assert len(padded) == 10 and all(stepped_length(n) == n for n in padded)
    assert len(set(padded)) <= 5 < len(padded), padded
    assert "stepped" in report.batching_note
    assert f"10 batches padded to {len(set(padded))} lengths" in report.batching_note
    assert_stores_each_clip_alone(tmp_path / "s", report.root, tmp_path / "clips", module)


#: Batches of 4 in length order: three padded 0.2 s, then three padded less (0.15-0.12 s, a
#: smaller fraction each): the guard checks the first three only.
LESS_PADDED_LATER = [1.0, 1.1, 1.1, 1.2, 1.3, 1.4, 1.45, 1.5, 1.6, 1.7, 1.75, 1.8,
                     1.9, 1.95, 2.0, 2.05, 2.1, 2.15, 2.2, 2.25, 2.3, 2.35, 2.4, 2.42]  # fmt: skip


def test_the_guard_skips_batches_padded_less_than_one_checked_at_a_length_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 31 item 5: one check per padded batch cost 49.5% of a GPU build (each a new length
    alone). Stepped (as on a GPU), the last three batches are all padded to 36,864 samples: the
    first of them is checked (a new length), the two padded less after it are not (main: 6
    checks for 6 batches)."""
    monkeypatch.setattr(batching, "PAD_LENGTHS", PadLengths.STEPPED)
    write_clips(tmp_path / "clips", [*LESS_PADDED_LATER[:12], *SAME_STEPPED_LENGTH])
    module = LengthsEncoder()
    calls = record_calls(module)
    report = build(tmp_path / "clips", module, cache=tmp_path / "s", workers=0, batch_size=4,
                   batching="padded")  # fmt: skip
    assert report.ok and report.batching == BatchingMode.PADDED
    assert [rows for rows, _ in calls] == [4, 1, 4, 1, 4, 1, 4, 1, 4, 4]
    assert [n for rows, n in calls if rows == 4][-3:] == [36864] * 3
    assert "6 batches padded to 4 lengths, stepped; 4 checked" in report.batching_note
    assert_stores_each_clip_alone(tmp_path / "s", report.root, tmp_path / "clips", module)


#: Twelve clips of 2.06-2.18 s: three batches of 4 whose longest steps up to 36,864 samples,
#: each padded less than the one before (2.06 s is 3,904 samples short of it, 2.17 s 2,144).
SAME_STEPPED_LENGTH = [2.06, 2.08, 2.1, 2.12, 2.13, 2.14, 2.15, 2.16, 2.17, 2.175, 2.18, 2.18]


def test_a_batch_padded_to_a_length_no_checked_batch_was_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An encoder may choose its code path by its input's length (chunked attention past a
    length, say). Stepped, the last batch's clips (all under 2.048 s) are padded past 32,768
    samples, where this one adds 0.5; that batch is padded by fewer samples and a smaller
    fraction than batches checked before, and the review's build stored its clips wrong. A new
    padded length is always checked: the build falls back and stores each clip as run alone."""
    monkeypatch.setattr(batching, "PAD_LENGTHS", PadLengths.STEPPED)
    seconds = [0.5, 0.6, 0.9, 1.0, 1.1, 1.2, 1.3, 1.35, 1.4, 1.98, 1.99, 2.0]
    write_clips(tmp_path / "clips", seconds)
    module = ChangesPastLength(32768)
    report = build(tmp_path / "clips", module, cache=tmp_path / "s", workers=0, batch_size=3,
                   batching="padded")  # fmt: skip
    assert report.ok and report.encoded == 12
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    assert_stores_each_clip_alone(tmp_path / "s", report.root, tmp_path / "clips", module)


class ChangesPastLength(nn.Module):
    """:class:`LengthsEncoder`, plus 0.5 once its input (padded or not) is ``length`` long."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self.inner = LengthsEncoder()

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_lengths = self.inner(wav, lengths)
        if wav.shape[-1] >= self.length:
            feats = feats + 0.5
        return feats, out_lengths


def test_a_batch_padded_more_than_any_checked_is_checked_and_its_leak_caught(
    tmp_path: Path, pad_lengths: PadLengths
) -> None:
    """The guard's trust with fewer checks: after three checked batches and two skipped ones,
    a last batch padded by 1.5 s (more than any checked) is checked; padding leaks past 1 s,
    so the build falls back and every stored feature equals the encoder run alone."""
    write_clips(tmp_path / "clips", [*LESS_PADDED_LATER[:20], 2.5, 2.6, 2.7, 4.0])
    module = LatePaddingLeak(threshold=16000)
    report = build(tmp_path / "clips", module, cache=tmp_path / "s", workers=0, batch_size=4,
                   batching="padded")  # fmt: skip
    assert report.ok and report.encoded == 24
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    plain = LatePaddingLeak(threshold=16000)
    plain.load_state_dict(module.state_dict())
    assert_stores_each_clip_alone(tmp_path / "s", report.root, tmp_path / "clips", plain)


def test_a_hugging_face_folder_padded_to_stepped_lengths_equals_transformers_per_clip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU build of a wav2vec2 folder now does (stepped lengths, forced here on the CPU):
    the extra padding is masked like the rest, and each stored clip equals transformers run on
    that clip alone."""
    pytest.importorskip("transformers")
    from tests.encode.test_hf import reference, save_model

    monkeypatch.setattr(batching, "PAD_LENGTHS", PadLengths.STEPPED)
    clips = tmp_path / "clips"
    write_audio_folder(clips, 8, seconds=(0.2, 1.5), seed=3)
    folder = save_model(tmp_path / "w2v2")
    report = build(clips, folder, cache=tmp_path / "s", workers=0, batch_size=4,
                   batching="padded")  # fmt: skip
    assert report.ok and report.batching == BatchingMode.PADDED, report.batching_note
    assert "stepped" in report.batching_note
    for rel, parts in stored_features(tmp_path / "s", report.root).items():
        want = reference(folder, clips / rel).last_hidden_state[0]
        assert rel_error(parts[""], want) < 1e-4, rel


# == test_padded_redo ==============================================================================
# Padding found inexact in a later batch: the items earlier padded batches sealed are encoded
# again alone and replace theirs (bake/pipeline.py), so every served item equals the encoder run now
# on that item alone, whatever batch it was first encoded in.

#: Padding below this many samples (but not none) shifts the output: the most padded item of a
#: batch, the one the guard re-runs, passes while its less padded neighbours are off.
LITTLE = 1600


class LittlePaddingLeaks(nn.Module):
    """A lengths encoder whose output is off by 0.5 when its input is padded by 1..LITTLE-1."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = LengthsEncoder()
        self.little = LITTLE  # an attribute, so that TorchScript can script it too

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        feats, out_lengths = self.inner(wav, lengths)
        pad = wav.shape[-1] - lengths
        bump = ((pad > 0) & (pad < self.little)).to(feats.dtype) * 0.5
        return feats + bump[:, None, None], out_lengths


def clips(root: Path) -> Path:
    """Batches of three (batch_size=3, sorted by length): in the first three the shortest clip
    is padded by 0.5 s (the guard passes) and the middle one by 0.04 s (off); in the last, all
    three are within 0.04 s (the guard fails there)."""
    seconds = [1.0, 0.96, 0.5, 1.5, 1.46, 1.0, 2.0, 1.96, 1.5, 2.5, 2.48, 2.46]
    for n, sec in enumerate(seconds):
        write_audio_folder(root / f"c{n:02d}", 1, seconds=sec, seed=n)
    return root


def alone_plain(module: nn.Module, path: Path) -> torch.Tensor:
    x = source_for(Recipe()).load(path)
    with torch.inference_mode():
        feats, n = module(x[None], torch.tensor([x.shape[-1]]))
    return feats[0, : int(n[0])]


def assert_serves_alone(
    data: Path, module: nn.Module, encoder: Path | None = None, **kw: object
) -> None:
    """Every item of ``data``, served from the store built with ``encoder`` (default:
    ``module`` itself, e.g. its TorchScript file), equals ``module`` run on it alone."""
    ds = CachedFeatureDataset(data, encoder or module, on_miss="error", **kw)  # type: ignore[arg-type]
    assert len(ds) == 12
    for i in range(len(ds)):
        want = alone_plain(module, Path(ds.path(i)))
        torch.testing.assert_close(ds[i], want, rtol=1e-4, atol=1e-5, msg=ds.path(i))


def test_items_sealed_before_the_guard_failed_are_encoded_again_alone(tmp_path: Path) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    store = tmp_path / "store"
    report = build(data, module, cache=store, workers=0, batch_size=3, batching="padded")
    assert report.ok and report.encoded == 12
    assert report.batching == BatchingMode.EXACT and "not exact" in report.batching_note
    assert "items padded before were encoded again alone" in report.batching_note
    assert_serves_alone(data, module, cache=store)  # main: 3 of 12 off by 0.5
    assert_store_consistent(store)
    again = build(data, module, cache=store, workers=0, batch_size=3)
    assert (again.encoded, again.reused) == (0, 12)


def interrupted_after_padded_batches(
    data: Path, encoder: Path, store: Path, at: int = 9, **kw: Any
) -> None:
    """A padded build of ``data`` stopped (Ctrl-C) once ``at`` items were encoded: by default
    three batches of three, which passed the padding check and were sealed, before the late
    batch that fails it; at 12, after that batch failed it and before the items padded before
    it were encoded again."""

    def stop(p: Progress) -> None:
        if p.phase == "encode" and p.done >= at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(data, encoder, cache=store, workers=0, batch_size=3, batching="padded",
              progress=stop, **kw)  # fmt: skip


def test_a_rerun_encodes_again_alone_what_a_stopped_build_stored_padded(tmp_path: Path) -> None:
    """Which items came from padded batches was known only to the run that padded them: a
    build stopped (killed, Ctrl-C) before its late batch failed the padding check left 9 items
    stored padded, and its rerun, whose own check failed, reused them as they were (3 of 12
    served off by 0.5). The record the stopped build left has the rerun encode them again
    alone, as an uninterrupted build does, and the build's end removes the record."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    interrupted_after_padded_batches(data, encoder, store)
    assert list((store / "roots").glob("*.padding"))  # what the stopped build set out to do
    again = build(data, encoder, cache=store, workers=0, batch_size=3, batching="padded")
    assert again.ok and again.reused == 9, again
    assert "the 9 items padded before were encoded again alone" in again.batching_note
    assert_serves_alone(data, module, encoder, cache=store)
    assert not list((store / "roots").glob("*.padding"))
    assert_store_consistent(store)


def test_a_rerun_after_a_padding_check_failed_encodes_again_what_was_stored_padded(
    tmp_path: Path,
) -> None:
    """Stopped after its check failed and before it encoded the padded items again, a build
    left them stored padded; its rerun encoded nothing and ran no check. The record says the
    check failed: the rerun encodes them again, alone."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    interrupted_after_padded_batches(data, encoder, store)
    (record,) = (store / "roots").glob("*.padding")
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "inexact": True}))  # as written before the redo
    build(data, encoder, cache=store, workers=0, batch_size=3, batching="exact")
    assert_serves_alone(data, module, encoder, cache=store)


def test_a_build_stopped_after_its_padding_check_failed_has_its_rerun_encode_them_again(
    tmp_path: Path,
) -> None:
    """The record said a check failed only once the encoding loop was over: a build stopped
    after its late batch failed the check, before the items padded before were encoded again,
    left a record saying none failed, and its rerun (nothing left to encode, no check run)
    kept them. The record says so as the check fails."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    interrupted_after_padded_batches(data, encoder, store, at=12)
    build(data, encoder, cache=store, workers=0, batch_size=3, batching="padded")
    assert_serves_alone(data, module, encoder, cache=store)


def test_a_rerun_of_a_build_whose_padding_check_failed_never_pads(tmp_path: Path) -> None:
    """A rerun whose record said a check had failed still padded its batches: it stored the
    items again padded (off by 0.5, served to any reader of the store meanwhile) and only at
    its end encoded them alone; stopped before then, they stayed. It runs exact shapes from
    its first batch now, saying why, and never pads what it stores."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    interrupted_after_padded_batches(data, encoder, store, at=12)  # the check failed
    interrupted_after_padded_batches(data, encoder, store, at=6)  # the rerun, stopped
    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    stored = 0
    for i in range(len(ds)):  # what it had not redone yet is a miss, never a padded row
        with contextlib.suppress(CacheMiss):
            got = ds[i]
            stored += 1
            want = alone_plain(module, Path(ds.path(i)))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=ds.path(i))
    assert stored >= 6  # what the rerun had encoded when stopped (the first run's all forgotten)
    again = build(data, encoder, cache=store, workers=0, batch_size=3, batching="padded")
    assert again.ok and again.batching == BatchingMode.EXACT
    assert "an earlier run of this build found padded batches not exact" in again.batching_note
    assert "encoded again alone" not in again.batching_note  # nothing padded to do again
    assert_serves_alone(data, module, encoder, cache=store)
    assert not list((store / "roots").glob("*.padding"))


def test_a_part_finishing_keeps_the_padding_record_another_part_left(tmp_path: Path) -> None:
    """The parts of a build (``--shard``) shared one record: part 0 finishing removed the one
    part 1, stopped, had left, and part 1's rerun kept what it had stored padded (3 items off
    by 0.5). Each part keeps its own record; a rerun reads them all."""
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    write_audio_folder(data / "z_ballast", 1, seconds=20.0, seed=99)  # part 0's alone
    encoder, store = save_torchscript(module, tmp_path / "leaky.pt"), tmp_path / "store"
    kw: dict[str, Any] = {"cache": store, "workers": 0, "batch_size": 3, "batching": "padded"}
    interrupted_after_padded_batches(data, encoder, store, shard="1/2")
    build(data, encoder, shard="0/2", **kw)
    assert [p.name.split(".")[1] for p in (store / "roots").glob("*.padding")] == ["1-of-2"]
    build(data, encoder, shard="1/2", **kw)
    merge(Layout(store))  # --shard parts are merged by `featbake merge`
    ds = CachedFeatureDataset(data, encoder, cache=store, on_miss="error")
    assert len(ds) == 13
    for i in range(len(ds)):
        want = alone_plain(module, Path(ds.path(i)))
        torch.testing.assert_close(ds[i], want, rtol=1e-4, atol=1e-5, msg=ds.path(i))


def test_padding_that_stays_exact_encodes_nothing_again(tmp_path: Path) -> None:
    data, module = clips(tmp_path / "clips"), LengthsEncoder()
    report = build(data, module, cache=tmp_path / "s", workers=0, batch_size=3, batching="padded")
    assert report.batching == BatchingMode.PADDED and "encoded again" not in report.batching_note
    assert_serves_alone(data, module, cache=tmp_path / "s")


def test_an_int8_build_stores_the_items_encoded_again_quantised_and_measures_each_once(
    tmp_path: Path,
) -> None:
    data, module = clips(tmp_path / "clips"), LittlePaddingLeaks()
    store = tmp_path / "store"
    recipe = Recipe(dtype="int8")
    report = build(data, module, cache=store, recipe=recipe, workers=0, batch_size=3)
    assert "items padded before were encoded again alone" in report.batching_note
    assert report.fidelity is not None and report.fidelity["items"] == 12
    ds = CachedFeatureDataset(data, module, cache=store, on_miss="error", dtype="int8")
    for i in range(len(ds)):
        want = dequantize(quantize(alone_plain(module, Path(ds.path(i))), Scheme.INT8), Scheme.INT8)
        assert torch.equal(ds[i], want), ds.path(i)


# == test_pace =====================================================================================
# Padded batches only where they pay (issue 19, item 4): the guard's runs time the device.
#
# Two stand-in encoders of the lengths protocol, each the real LengthsEncoder plus a sleep that
# models where the time goes: on a CPU a batch costs its rows times its padded length (and more:
# the larger working set), on a GPU a call costs about the same whatever its size. Under
# ``batching="auto"`` the first goes exact-shape after a few batches, the second stays padded;
# both store what the encoder gives each clip alone.


def test_no_verdict_before_the_warm_up_and_the_counted_batches() -> None:
    tally = PaceTally()
    for _ in range(WARMUP_BATCHES + DECIDE_AFTER - 1):
        tally.add(9.0, 10, 0.1, 10)
        assert tally.verdict() is Pace.UNDECIDED
    tally.add(9.0, 10, 0.1, 10)
    assert tally.verdict() is Pace.ALONE_FASTER


def test_the_warm_up_batch_is_not_counted() -> None:
    tally = PaceTally()
    tally.add(100.0, 10, 0.01, 10)  # a first call that paid for lazy init
    for _ in range(DECIDE_AFTER):
        tally.add(1.0, 100, 0.5, 10)  # 10 ms per sample padded, 50 ms alone
    assert tally.ratio() == pytest.approx(0.2)
    assert tally.verdict() is Pace.PADDED_PAYS


@pytest.mark.parametrize(("ratio", "want"), [(SLOWER_BY * 0.99, Pace.PADDED_PAYS),
                                             (SLOWER_BY * 1.01, Pace.ALONE_FASTER)])  # fmt: skip
def test_padded_batches_lose_only_past_the_margin(ratio: float, want: Pace) -> None:
    tally = PaceTally()
    for _ in range(WARMUP_BATCHES + DECIDE_AFTER):
        tally.add(ratio, 1000, 1.0, 1000)
    assert tally.verdict() is want


class DeviceClock:
    """A modelled device's clock: seconds advance only by what the encoder's calls cost, so the
    pace verdict is the same on a quiet machine and a busy one (the build reads it through
    ``featbake.bake.batching.pace_clock``)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedLengthsEncoder(LengthsEncoder):
    """LengthsEncoder whose calls cost modelled device time on ``clock``."""

    def __init__(self, clock: DeviceClock, per_call: float, per_padded_sample: float) -> None:
        super().__init__()
        self.clock = clock
        self.per_call = per_call
        self.per_padded_sample = per_padded_sample

    def forward(
        self, wav: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, padded = wav.shape
        batch_cost = 1.5 if rows > 1 else 1.0  # a CPU: batches cost more per sample
        self.clock.now += self.per_call + self.per_padded_sample * rows * padded * batch_cost
        return super().forward(wav, lengths)


@pytest.fixture
def device_clock(monkeypatch: pytest.MonkeyPatch) -> DeviceClock:
    clock = DeviceClock()
    monkeypatch.setattr("featbake.bake.batching.pace_clock", clock)
    return clock


@pytest.fixture
def paced_clips(tmp_path: Path) -> Path:
    root = tmp_path / "clips"
    write_audio_folder(root, 24, seconds=(0.3, 1.5), seed=13)
    return root


def assert_paced_clips_alone(cache: Path, root: str, paced_clips: Path) -> None:
    module = LengthsEncoder()
    stored = stored_features(cache, root)
    assert len(stored) == 24
    for rel, parts in stored.items():
        x = source_for(Recipe()).load(paced_clips / rel)
        with torch.inference_mode(), autocast_for(torch.device("cpu"), "fp32"):
            feats, n = module(x[None], torch.tensor([x.shape[-1]]))
        assert rel_error(parts[""], feats[0, : int(n[0])]) < 1e-4, rel


def test_a_device_where_batches_cost_per_sample_goes_exact_and_says_why(
    tmp_path: Path, paced_clips: Path, device_clock: DeviceClock
) -> None:
    cpu_like = TimedLengthsEncoder(device_clock, per_call=0.0, per_padded_sample=2e-7)
    report = build(paced_clips, cpu_like, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 24
    assert report.batching == BatchingMode.EXACT, report.batching_note
    assert "time per input sample of clips run alone" in report.batching_note
    assert "--batching padded keeps them" in report.batching_note
    assert_paced_clips_alone(tmp_path / "s", report.root, paced_clips)
    forced = build(
        paced_clips, cpu_like, cache=tmp_path / "p", workers=0, batch_size=4, batching="padded"
    )
    assert forced.batching == BatchingMode.PADDED  # asked for: never timed away


def test_a_device_where_a_call_costs_the_same_at_any_size_stays_padded(
    tmp_path: Path, paced_clips: Path, device_clock: DeviceClock
) -> None:
    gpu_like = TimedLengthsEncoder(device_clock, per_call=0.02, per_padded_sample=0.0)
    report = build(paced_clips, gpu_like, cache=tmp_path / "s", workers=0, batch_size=4)
    assert report.ok and report.encoded == 24
    assert report.batching == BatchingMode.PADDED, report.batching_note
    assert "checked, the first 3 and each padded unlike any before" in report.batching_note
    assert_paced_clips_alone(tmp_path / "s", report.root, paced_clips)
