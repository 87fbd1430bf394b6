"""gc's over-budget note (up10.5, up10.6): what it tells a user to run works when pasted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.filesystem import SharedFilesystemWarning
from featbake.upkeep import drop_root
from tests.conftest import invoke
from tests.helpers import bake


def test_the_merge_the_over_budget_note_names_merges_the_store_gc_ran_on(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    first = bake(audio_dir, encoder_file, store)
    drop_root(store, first.root)
    monkeypatch.setenv("FEATBAKE_SHARED_FS", "1")
    with pytest.warns(SharedFilesystemWarning):
        ds = CachedFeatureDataset(audio_dir, encoder_file, cache=store)
    assert ds.stored() == 16
    ds.close()
    monkeypatch.undo()
    monkeypatch.delenv("FEATBAKE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    (note,) = [line for line in r.stderr.splitlines() if "over --max-bytes" in line]
    command = re.search(r"run `(featbake merge[^`]*)`", note)
    assert command is not None, note
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pasted = invoke(*command.group(1).split()[1:], cwd=elsewhere)
    assert pasted.returncode == 0, pasted.stderr
    r = invoke("gc", "--cache", store, "--max-bytes", "1", "--grace", "0s")
    assert "over --max-bytes" not in r.stderr, r.stderr
