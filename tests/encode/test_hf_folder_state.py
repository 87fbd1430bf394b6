"""A Hugging Face folder's remembered fingerprint (fingerprints.FolderState): each way the folder,
featbake's code or the process could change what a load gives, against the fingerprint loading
the folder gives now. Tiny models built from configs here, saved with save_pretrained."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import featbake.encode.fingerprints as fingerprints
import featbake.encode.hf as hf
from featbake.bake.pipeline import build
from featbake.encode.hf import load_hf_folder
from featbake.errors import FeatbakeError
from featbake.serve.dataset import CachedFeatureDataset
from featbake.store.catalog import Catalog
from featbake.store.hash_cache import RACY_NS
from featbake.store.layout import Layout
from featbake.testing import write_audio_folder
from tests.encode.test_hf import save_model

transformers = pytest.importorskip("transformers")


@pytest.fixture
def as_installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process imported transformers to save the models; untouched, it is taken for a
    process that did not (as a command's is), except where a test says otherwise."""
    monkeypatch.setattr(fingerprints, "transformers_as_installed", lambda: True, raising=False)
    yield


def record(folder: Path, store: Path, *, later: bool = True) -> str:
    """Load ``folder`` and fingerprint it through the hash cache (as a build does); ``later``:
    by the clock of a folder saved a while before (out of the racy window)."""
    real = time.time_ns
    shift = 3 * RACY_NS if later else 0
    saved = hf.time
    hf.time = SimpleNamespace(time_ns=lambda: real() + shift)  # type: ignore[assignment]
    try:
        enc = load_hf_folder(folder)
    finally:
        hf.time = saved
    with Catalog(Layout(store)) as cat:
        return fingerprints.encoder_fingerprint(enc, cat, None)


def cached(folder: Path, store: Path) -> str | None:
    with Catalog(Layout(store)) as cat:
        return fingerprints.cached_file_encoder_fp(cat, folder)


def rewrite_keeping_stat(path: Path, offset_from_end: int = 8) -> None:
    """Change four bytes of ``path`` in place (same inode, same size), its mtime set back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(st.st_size - offset_from_end)
        old = f.read(4)
        f.seek(st.st_size - offset_from_end)
        f.write(bytes(b ^ 0x01 for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    now = os.stat(path)
    assert (now.st_size, now.st_mtime_ns, now.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)


def test_a_file_rewritten_in_place_keeping_size_and_mtime_is_a_miss(
    tmp_path: Path, as_installed: None
) -> None:
    folder, store = save_model(tmp_path / "m"), tmp_path / "s"
    first = record(folder, store)
    assert cached(folder, store) == first
    rewrite_keeping_stat(folder / "model.safetensors")
    assert cached(folder, store) is None  # its ctime moved
    assert record(folder, store) == load_hf_folder(folder).fingerprint != first


def hub_snapshot(folder: Path, root: Path) -> Path:
    """``folder`` laid out as the Hugging Face hub cache does: a snapshot of symlinks to blobs."""
    blobs, snap = root / "blobs", root / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(folder.iterdir())):
        blob = blobs / f"blob{i}"
        shutil.copy2(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return snap


def test_a_hub_snapshots_symlinks_are_followed(tmp_path: Path, as_installed: None) -> None:
    """A hub snapshot is symlinks to blobs: the blob behind one rewritten (size and mtime kept),
    or the link pointed at another blob of the same size and mtime, loads another model."""
    snap = hub_snapshot(save_model(tmp_path / "m"), tmp_path / "hub")
    store = tmp_path / "s"
    first = record(snap, store)
    assert cached(snap, store) == first
    weights = snap / "model.safetensors"
    rewrite_keeping_stat(weights.resolve())
    assert cached(snap, store) is None
    second = record(snap, store)
    assert second != first and cached(snap, store) == second

    other = weights.resolve().with_name("other-blob")
    shutil.copy2(weights.resolve(), other)
    rewrite_keeping_stat(other, offset_from_end=40)
    os.utime(other, ns=(os.stat(other).st_atime_ns, os.stat(weights).st_mtime_ns))
    link = snap / "new-link"
    link.symlink_to(os.path.relpath(other, snap))
    os.replace(link, weights)  # the link repointed
    assert cached(snap, store) is None
    assert record(snap, store) == load_hf_folder(snap).fingerprint not in (first, second)


def test_a_sharded_folder_shard_rewritten_in_place_is_a_miss(
    tmp_path: Path, as_installed: None
) -> None:
    """Weights in shards with an index (save_pretrained's max_shard_size): each shard is a
    top-level file of the folder, so one rewritten in place is a miss."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
    )  # fmt: skip
    folder, store = tmp_path / "sharded", tmp_path / "s"
    transformers.Wav2Vec2Model(config).eval().save_pretrained(folder, max_shard_size="40KB")
    transformers.Wav2Vec2FeatureExtractor(return_attention_mask=True).save_pretrained(folder)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    first = record(folder, store)
    assert cached(folder, store) == first
    rewrite_keeping_stat(shards[-1])
    assert cached(folder, store) is None
    assert record(folder, store) == load_hf_folder(folder).fingerprint != first


def test_a_fingerprint_recorded_within_the_racy_window_is_not_trusted(
    tmp_path: Path, as_installed: None
) -> None:
    """Recorded in the same second as the folder's last write (no clock shift): a file written
    again within that second could keep its stat, so the record is not read back."""
    folder, store = save_model(tmp_path / "m"), tmp_path / "s"
    record(folder, store, later=False)
    assert cached(folder, store) is None


def test_a_remote_code_folder_is_not_loaded_so_nothing_is_remembered(
    tmp_path: Path, as_installed: None
) -> None:
    """featbake never runs a folder's code (it passes trust_remote_code=False, where leaving it
    unset made transformers wait 15 s on a prompt): a folder whose model is its own code (an
    auto_map to modeling code importing a module beside it) is refused in one line saying so,
    and nothing recorded."""
    folder, store = tmp_path / "custom", tmp_path / "s"
    folder.mkdir()
    (folder / "helper.py").write_text("SCALE = 2.0\n")
    (folder / "modeling_x.py").write_text("from .helper import SCALE\n")
    auto_map = {"AutoConfig": "modeling_x.XConfig", "AutoModel": "modeling_x.XModel"}
    config = {"model_type": "featbake-x", "architectures": ["XModel"], "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(FeatbakeError, match="holds a model of its own code") as refused:
        record(folder, store)
    assert "\n" not in str(refused.value)
    assert cached(folder, store) is None


def patch_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's process changing what transformers builds: every Wav2Vec2Config made with no
    layer drop (a training script's patch), whatever the folder's config.json says."""
    real = transformers.Wav2Vec2Config.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)
        self.layerdrop = 0.0  # type: ignore[attr-defined]

    monkeypatch.setattr(transformers.Wav2Vec2Config, "__init__", init)


def test_a_process_that_patched_transformers_neither_reads_nor_writes_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fingerprint a load gives keys the model's config and tensors: a process that patched
    transformers' classes loads another fingerprint. Read from the hash cache, the
    fingerprint recorded by a process with transformers as installed was that process's;
    written, this process's would be read by the next clean process."""
    folder, store = save_model(tmp_path / "m"), tmp_path / "s"
    with monkeypatch.context() as m:
        m.setattr(fingerprints, "transformers_as_installed", lambda: True, raising=False)
        clean = record(folder, store)
        assert cached(folder, store) == clean
    patch_init(monkeypatch)
    here = load_hf_folder(folder).fingerprint
    assert here != clean  # the load sees the patch
    assert cached(folder, store) is None  # so the record is not this process's
    assert record(folder, store) == here
    monkeypatch.setattr(fingerprints, "transformers_as_installed", lambda: True, raising=False)
    assert cached(folder, store) == clean  # and the patched load recorded nothing


def test_a_dataset_in_a_process_that_patched_transformers_loads_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training process that patched transformers' model class, then opened a dataset over a
    folder a clean build stored: the features stored are another model's than the one this
    process's load gives, so none is served as its (on_miss='error' refuses the miss)."""
    clips, folder, store = tmp_path / "clips", save_model(tmp_path / "m"), tmp_path / "s"
    write_audio_folder(clips, 2, seconds=(0.3, 0.6), seed=1)
    with monkeypatch.context() as m:
        m.setattr(fingerprints, "transformers_as_installed", lambda: True, raising=False)
        m.setattr(hf, "time", SimpleNamespace(time_ns=lambda: time.time_ns() + 3 * RACY_NS))
        report = build(clips, folder, cache=store, workers=0)
        assert report.encoded == 2 and cached(folder, store) == report.encoder_fp
    patch_init(monkeypatch)
    ds = CachedFeatureDataset(clips, folder, cache=store, on_miss="error")
    with pytest.raises(FeatbakeError):
        ds[0]


def test_featbake_code_outside_the_named_modules_changes_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load decides by code in other modules than the adapter's (hf_folders.py: a text,
    vision or audio folder; outputs.py), and those modules are where code moves to (the
    recipe's readings left hf.py for hf_folders.py): a change to either is another state, also
    in a process that read the state before (the digest is kept only while no file's stat
    changes)."""
    folder = save_model(tmp_path / "m")
    code = tmp_path / "code"
    shutil.copytree(Path(hf.__file__).parent.parent, code,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    monkeypatch.setattr(fingerprints, "_PACKAGE", code)
    state = fingerprints.FolderState.of(folder)
    assert state is not None
    for rel in ("encode/hf_folders.py", "encode/outputs.py"):
        with (code / rel).open("a") as f:
            f.write("\n")
        now = fingerprints.FolderState.of(folder)
        assert now is not None and now.cache_id != state.cache_id, rel
        state = now
