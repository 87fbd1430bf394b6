"""``featbake verify --encoder``: a store spot-checked against its encoder run now.

Every store here is built by ``featbake build`` in a subprocess from audio and an encoder file
the test wrote; the spot check re-encodes through the dataset's live path, so what it calls a
match is what running the encoder now gives.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

from featbake.encode.encoders import EXACT_TOLERANCE, training_submodule
from featbake.recipe import Recipe
from featbake.serve.spot_check import (
    INPUTS_CHANGED,
    NOTHING_COMPARED,
    SPOT_CHECK_MISMATCH,
    STORAGE_ERROR,
    SpotCheckReport,
    Verdict,
    compare,
    spot_check,
    tolerance,
)
from featbake.store.catalog import Catalog
from featbake.store.layout import Layout
from featbake.store.shard import ShardReader, ShardWriter, split_tensor_name
from featbake.testing import TinyConvEncoder, save_torchscript
from tests.conftest import invoke, run_cli
from tests.helpers import shard_files


def _build(encoder: Path, audio: Path, store: Path, *options: str) -> None:
    r = run_cli("build", "--encoder", encoder, "--data", audio, "--cache", store,
                "--workers", "0", *options)  # fmt: skip
    assert r.returncode == 0, r.stderr


def _store_state(store: Path) -> dict[str, str]:
    """Every file of the store and a digest of its bytes: what a check that writes changes.
    SQLite's own reader files are left out (a reader of a WAL catalog makes its shared-memory
    index and an empty WAL: no row in them)."""
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file()
        and not p.name.endswith("-shm")
        and not (p.name.endswith("-wal") and p.stat().st_size == 0)
    }


def _verify(encoder: Path, audio: Path, store: Path, *options: str):
    return invoke("verify", "--encoder", encoder, "--data", audio, "--cache", store, *options)


def test_a_clean_store_passes_and_nothing_is_written(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir)
    before = _store_state(store_dir)
    r = _verify(encoder_file, audio_dir, store_dir, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["checked"], doc["mismatched"], doc["missing"]) == (16, 0, 0)
    assert doc["likely_cause"] is None and doc["exit_code"] == 0
    assert all(c["max_abs_error"] <= c["tolerance"] for c in doc["checks"])
    assert _store_state(store_dir) == before  # not a hash row, a root or a last use written

    r = _verify(encoder_file, audio_dir, store_dir, "--sample", "5", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "5 of 16 items" in r.stdout and "0 mismatched, 0 missing" in r.stdout


def _forge(store: Path, shard: Path) -> set[str]:
    """Replace ``shard`` by a forged one: a real shard of the same tensors (names, shapes,
    dtypes, valid CRCs, named by its content) holding other values, the catalog's rows pointed
    at it. Returns the keys it holds."""
    layout = Layout(store)
    with ShardReader(shard) as r:
        meta = r.metadata
        tensors = {name: r.read(name) for name in r.tensors}
    entries = {name: split_tensor_name(name) for name in tensors}
    sealed = []
    with ShardWriter(layout, meta["encoder_fp"], meta["recipe_fp"], on_seal=sealed.append) as w:
        for name, t in tensors.items():
            key, part = entries[name]
            w.add(key, {part: t.flip(0) + 0.05})  # plausible values, other ones
    shard.unlink()  # the catalog's rows now name a shard that is gone: add_shard re-points them
    with Catalog(layout) as cat:
        for s in sealed:
            cat.add_shard(s)
    return {k for k, _ in entries.values()}


def test_a_forged_shard_passes_the_byte_checks_and_is_caught_with_its_items_named(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir, "--shard-size", "40KiB")
    victim = sorted(shard_files(store_dir))[0]
    forged_keys = _forge(store_dir, victim)
    assert invoke("verify", "--cache", store_dir).returncode == 0  # bytes, CRCs, rows: all sound

    report = spot_check(audio_dir, encoder_file, cache=store_dir, sample=100)
    assert isinstance(report, SpotCheckReport)
    bad = {c.item for c in report.of(Verdict.MISMATCH)}
    assert bad and {c.key for c in report.of(Verdict.MISMATCH)} == forged_keys
    assert report.checked == 16 and report.missing == 0 and report.likely_cause is None
    assert report.exit_code == SPOT_CHECK_MISMATCH

    r = _verify(encoder_file, audio_dir, store_dir, "--sample", "100")
    assert r.returncode == SPOT_CHECK_MISMATCH, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("mismatch ")]
    assert {ln.split()[1].rstrip(":") for ln in lines} == bad
    assert all("max abs error" in ln and "tolerance" in ln for ln in lines)
    assert f"{len(bad)} mismatched, 0 missing" in r.stdout


class _DropoutEncoder(nn.Module):
    """TinyConvEncoder with dropout after it: left in train mode, every run differs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = TinyConvEncoder()
        self.drop = nn.Dropout(0.3)

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        return self.drop(self.body(wav))


def test_an_encoder_exported_in_train_mode_is_named_as_the_likely_cause(
    tmp_path: Path, audio_dir: Path, store_dir: Path
) -> None:
    program = torch.export.export(
        _DropoutEncoder().train(),  # the mistake: exported before .eval(), dropout kept on
        (torch.randn(2, 16000),),
        dynamic_shapes={"wav": {0: Dim.AUTO, 1: Dim.AUTO}},  # dropout's guard: AUTO infers
    )
    encoder = tmp_path / "dropout.pt2"
    torch.export.save(program, str(encoder))
    _build(encoder, audio_dir, store_dir)

    r = _verify(encoder, audio_dir, store_dir, "--sample", "4")
    assert r.returncode == SPOT_CHECK_MISMATCH, r.stderr
    causes = [ln for ln in r.stderr.splitlines() if ln.startswith("likely cause:")]
    assert len(causes) == 1 and "train mode" in causes[0], r.stderr
    assert "4 mismatched" in r.stdout


def test_a_store_built_with_another_encoder_is_no_such_root_in_one_line(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir)
    other = save_torchscript(TinyConvEncoder(seed=7), tmp_path / "other.pt")
    before = _store_state(store_dir)
    r = _verify(other, audio_dir, store_dir)
    assert r.returncode == 7, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "no root of" in r.stderr
    assert str(encoder_file.resolve()) in r.stderr  # what the store's root was built with
    assert _store_state(store_dir) == before


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_rounded_stored_dtype_passes_within_its_tolerance(
    dtype: str, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir, "--dtype", dtype)
    report = spot_check(audio_dir, encoder_file, cache=store_dir, recipe=Recipe(dtype=dtype))
    assert (report.checked, report.mismatched, report.dtype) == (16, 0, dtype)
    assert all(c.max_abs_error <= c.tolerance for c in report.checks)
    # The rounding shows: past what float32 storage would be allowed (the fp32 share of each
    # tolerance), so the tolerance is the stored dtype's, and float32's would fail the store.
    fp32 = EXACT_TOLERANCE["fp32"].relative
    share = fp32 / (fp32 + STORAGE_ERROR[dtype])
    assert any(c.max_abs_error > c.tolerance * share for c in report.checks)
    r = _verify(encoder_file, audio_dir, store_dir, "--dtype", dtype)
    assert r.returncode == 0, r.stderr + r.stdout


def test_items_the_store_lacks_are_missing_not_mismatched(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir, "--shard-size", "40KiB")
    shard = sorted(shard_files(store_dir))[0]
    with ShardReader(shard) as r:
        gone = {split_tensor_name(name)[0] for name in r.tensors}
    with Catalog(Layout(store_dir)) as cat, cat.transaction() as c:
        c.executemany("DELETE FROM features WHERE key=?", [(k,) for k in gone])
    report = spot_check(audio_dir, encoder_file, cache=store_dir, sample=100)
    assert {c.key for c in report.of(Verdict.MISSING)} == gone
    assert report.mismatched == 0 and report.exit_code == 0


def test_a_spot_check_that_compared_no_item_does_not_exit_0(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir)
    con = sqlite3.connect(store_dir / "catalog.sqlite")
    con.execute("DELETE FROM features")  # as a gc --max-bytes eviction leaves a root
    con.commit()
    con.close()
    r = _verify(encoder_file, audio_dir, store_dir, "--json")
    doc = json.loads(r.stdout)
    assert (doc["checked"], doc["missing"], doc["changed"]) == (0, 16, 0)
    assert r.returncode == doc["exit_code"] == NOTHING_COMPARED == 7  # never "the store matches"
    r = _verify(encoder_file, audio_dir, store_dir)
    assert r.returncode == 7 and r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing to compare: 16 of 16 sampled items" in lines[0]
    assert "16 evicted or deleted" in lines[0], lines[0]


def _rewrite(path: Path) -> None:
    """Other bytes in ``path``, its size and mtime kept (what a stat-only check misses)."""
    st = path.stat()
    path.write_bytes(b"x" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_inputs_changed_since_the_build_are_not_a_clean_spot_check(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir)
    wavs = sorted(audio_dir.rglob("*.wav"))
    _rewrite(wavs[0])
    r = _verify(encoder_file, audio_dir, store_dir, "--json")
    doc = json.loads(r.stdout)
    assert (doc["checked"], doc["changed"], doc["missing"], doc["mismatched"]) == (15, 1, 0, 0)
    assert r.returncode == doc["exit_code"] == INPUTS_CHANGED == 13
    (changed,) = [c for c in doc["checks"] if c["verdict"] == Verdict.CHANGED]
    assert (audio_dir / changed["item"]).resolve() == wavs[0].resolve()
    r = _verify(encoder_file, audio_dir, store_dir)
    assert r.returncode == 13, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("changed since the build ")]
    assert "1 changed since the build" in r.stdout

    for p in wavs[1:]:
        _rewrite(p)
    r = _verify(encoder_file, audio_dir, store_dir, "--json")
    doc = json.loads(r.stdout)
    assert (doc["checked"], doc["changed"], doc["missing"]) == (0, 16, 0)
    assert r.returncode == 7
    r = _verify(encoder_file, audio_dir, store_dir)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 7 and len(lines) == 1 and "16 changed since the build" in lines[0]


def test_an_encoder_exported_after_eval_is_not_named_in_train_mode(
    tmp_path: Path, audio_dir: Path, store_dir: Path
) -> None:
    shapes = {"wav": {0: Dim.AUTO, 1: Dim.AUTO}}
    program = torch.export.export(
        TinyConvEncoder().eval(),  # exported as the message says to
        (torch.randn(2, 16000),),
        dynamic_shapes=shapes,
    )
    assert program.module().training  # torch's, whatever the mode it was exported in
    assert training_submodule(program.module()) is None
    dropout = torch.export.export(_DropoutEncoder().train(), (torch.randn(2, 16000),),
                                  dynamic_shapes=shapes)  # fmt: skip
    assert "aten.dropout.default with train=True" in str(training_submodule(dropout.module()))
    encoder = tmp_path / "tiny.pt2"
    torch.export.save(program, str(encoder))
    _build(encoder, audio_dir, store_dir)
    r = _verify(encoder, audio_dir, store_dir, "--json")
    doc = json.loads(r.stdout)
    assert (doc["checked"], doc["mismatched"], r.returncode) == (16, 0, 0)  # a clean store
    assert doc["likely_cause"] is None, doc["likely_cause"]
    r = _verify(encoder, audio_dir, store_dir)
    assert "likely cause" not in r.stderr, r.stderr


def test_spot_check_options_without_encoder_are_not_ignored_unsaid(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    _build(encoder_file, audio_dir, store_dir)
    r = invoke("verify", "--cache", store_dir, "--sample", "64", "--dtype", "int8")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--sample/--dtype are for a spot check: give --encoder and --data" in lines[0]
    r = invoke("verify", "--cache", store_dir)
    assert r.returncode == 0 and "verify: clean" in r.stdout, r.stderr


class _NanFirst(nn.Module):
    """TinyConvEncoder with its first value NaN (a log of a silent frame, say); ``noisy``: plus
    another offset at every run, what the spot check exists to catch."""

    def __init__(self, noisy: bool) -> None:
        super().__init__()
        self.body = TinyConvEncoder()
        self.noisy = noisy

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        out = self.body(wav)
        if self.noisy:
            out = out + torch.rand(1) * 10.0
        out = out.clone()
        out[:, 0, 0] = float("nan")
        return out


@pytest.mark.parametrize("noisy", [False, True])
def test_a_nan_in_the_encoders_output_never_compares_as_within(
    tmp_path: Path, audio_dir: Path, store_dir: Path, noisy: bool
) -> None:
    """The tolerance was taken from the output's largest magnitude, NaN included, and a NaN
    error compared as within: every item of a nondeterministic encoder whose output holds one
    NaN (an --allow-nonfinite build) was a match. Now the scale is the finite values', a NaN
    (or the same inf) in both counts equal and any other non-finite difference is out."""
    encoder = save_torchscript(_NanFirst(noisy), tmp_path / "nan.pt")
    _build(encoder, audio_dir, store_dir, "--allow-nonfinite")
    report = spot_check(audio_dir, encoder, cache=store_dir, sample=4)
    assert isinstance(report, SpotCheckReport) and report.checked == 4
    want = Verdict.MISMATCH if noisy else Verdict.MATCH
    assert {c.verdict for c in report.checks} == {want}
    live = torch.ones(5, 4)
    for now, stored, verdict in [
        (float("nan"), 0.0, Verdict.MISMATCH),  # a NaN now against any stored value
        (1.0, float("nan"), Verdict.MISMATCH),
        (float("inf"), 1e30, Verdict.MISMATCH),
        (float("inf"), float("-inf"), Verdict.MISMATCH),
        (float("inf"), float("inf"), Verdict.MATCH),
        (float("nan"), float("nan"), Verdict.MATCH),
    ]:
        a, b = live.clone(), live.clone()
        a[0, 0], b[0, 0] = now, stored
        check = compare("x", "k", {"": b}, {"": a}, Recipe())
        assert check.verdict is verdict, (now, stored)
        assert check.tolerance == tolerance(Recipe(), live)  # the finite values' scale


def _damage(store: Path, how: str) -> set[str]:
    """Damage the first shard of an int8 store: one row scale's byte flipped (``checksum``: its
    checksum then fails), or every tensor's first row scale NaN in a shard rewritten with valid
    checksums (``scale``, as ``_forge`` rewrites one). Returns the keys damaged."""
    shard = sorted(shard_files(store))[0]
    with ShardReader(shard) as r:
        meta = r.metadata
        tensors = {name: r.read(name) for name in r.tensors}
        first = r.tensors[sorted(r.tensors)[0]]
    entries = {name: split_tensor_name(name) for name in tensors}
    if how == "checksum":
        raw = bytearray(shard.read_bytes())
        raw[first.begin + first.shape[-1] - 1] ^= 0x40  # row 0's scale, its top byte
        shard.chmod(0o644)
        shard.write_bytes(bytes(raw))
        return {entries[sorted(tensors)[0]][0]}
    layout, sealed = Layout(store), []
    with ShardWriter(layout, meta["encoder_fp"], meta["recipe_fp"], on_seal=sealed.append) as w:
        for name, t in tensors.items():
            key, part = entries[name]
            t = t.clone()
            t[0, -4:] = torch.tensor([float("nan")]).view(torch.int8)
            w.add(key, {part: t})
    shard.unlink()
    with Catalog(layout) as cat:
        for s in sealed:
            cat.add_shard(s)
    return {k for k, _ in entries.values()}


@pytest.mark.parametrize("how", ["checksum", "scale"])
def test_a_damaged_stored_item_is_damaged_exit_11_not_a_mismatch(
    encoder_file: Path, audio_dir: Path, store_dir: Path, how: str
) -> None:
    """A sampled item whose stored bytes are damaged was a mismatch (max abs error inf), exit 12,
    the code whose features --repair keeps; plain verify calls the shard damaged, exit 11. Now
    it is its own verdict, damaged, named with what to run, and the check exits 11."""
    from featbake.upkeep import VERIFY_DAMAGED

    _build(encoder_file, audio_dir, store_dir, "--dtype", "int8", "--shard-size", "40KiB")
    damaged = _damage(store_dir, how)
    report = spot_check(audio_dir, encoder_file, recipe=Recipe(dtype="int8"), cache=store_dir,
                        sample=100)  # fmt: skip
    assert isinstance(report, SpotCheckReport)
    assert {c.key for c in report.of(Verdict.DAMAGED)} == damaged
    assert report.mismatched == 0 and report.checked == 16 - len(damaged)
    assert report.exit_code == VERIFY_DAMAGED == 11
    r = _verify(encoder_file, audio_dir, store_dir, "--dtype", "int8", "--sample", "100")
    assert r.returncode == VERIFY_DAMAGED, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("damaged ")]
    assert len(lines) == len(damaged) and all("featbake verify --repair" in ln for ln in lines)
    assert f"{len(damaged)} damaged" in r.stdout and "0 mismatched" in r.stdout
