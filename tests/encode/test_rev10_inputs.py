"""Review of round ten's input rules (in10.*): reproductions of what they get wrong, on real
folders of real audio and parquet files, built through the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import invoke
from tests.encode.test_containers import wav_bytes, write_audio_parquet


@pytest.mark.xfail(
    strict=True,
    reason="in10.2 follows datasets' file-name patterns only: a Hub snapshot whose README.md "
    "`configs:` names its splits (data_files per split, the Hub's other way to declare them) "
    "is built as one table, the held-out file's rows served among the training ones, though "
    "load_dataset(snapshot) reads a DatasetDict of two splits",
)
def test_a_snapshot_whose_readme_configs_name_two_splits_is_refused(
    tmp_path: Path, encoder_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    clips = [wav_bytes(0.3 + 0.1 * i, 40 + i) for i in range(3)]
    snap = tmp_path / "snapshot"
    (snap / "shards").mkdir(parents=True)
    write_audio_parquet(snap / "shards" / "alpha.parquet", clips[:2], label=[0, 1])
    write_audio_parquet(snap / "shards" / "beta.parquet", clips[2:], label=[2])
    (snap / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n"
        "  - split: train\n    path: shards/alpha.parquet\n"
        "  - split: heldout\n    path: shards/beta.parquet\n---\n# a dataset card\n"
    )
    splits = datasets.load_dataset(str(snap))
    assert {s: len(d) for s, d in splits.items()} == {"train": 2, "heldout": 1}

    r = invoke("build", "--data", snap, "--encoder", encoder_file,
               "--cache", tmp_path / "store", "--column", "audio")  # fmt: skip
    assert r.returncode == 8, r.stdout + r.stderr  # built as one table: exit 0, 3 rows
