"""Issue 31 item 3: a first build reads each input once (hashed from the bytes it decodes).

Measured by what the build's process read (``rchar`` in /proc/self/io: every byte returned by
read(), from the disk or the page cache), not by time: the inputs' bytes dominate it, and a
first build used to read them twice (hashed, then decoded from the file again).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import featbake.encode.fingerprints
from featbake.bake.pipeline import build
from featbake.bake.report import BuildReport
from featbake.encode.sources import AudioSource
from featbake.recipe import Recipe
from featbake.testing import TinyConvEncoder, write_audio_folder
from tests.helpers import stored_features

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/io")


def _read_so_far() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _bytes_read_by_build(data: Path, cache: Path) -> int:
    enc = TinyConvEncoder().eval()
    build(data, enc, cache=cache.parent / "warm", workers=0)  # imports and loaders made once
    before = _read_so_far()
    report = build(data, enc, cache=cache, workers=0)
    read = _read_so_far() - before
    assert report.ok and report.encoded == len(list(data.iterdir()))
    return read


@pytest.mark.parametrize("held", [True, False])
def test_a_first_build_reads_its_inputs_once(
    tmp_path: Path, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "audio"
    write_audio_folder(data, 16, seconds=8.0, seed=3)  # 4 MiB of wav
    size = sum(p.stat().st_size for p in data.iterdir())
    if not held:  # the old way: no bytes kept, every input read again to decode
        monkeypatch.setattr(featbake.encode.fingerprints, "HELD_BYTES", 0)
    read = _bytes_read_by_build(data, tmp_path / "store")
    print(f"held={held}: read {read:,} bytes for {size:,} bytes of inputs ({read / size:.2f}x)")
    if held:
        assert read < 1.25 * size, (read, size)  # ~1.0x: the catalog's few pages beside it
    else:
        assert read > 1.9 * size, (read, size)  # what a first build read before
    # Decoded from the kept bytes or not, every stored feature is the encoder's now.
    enc, src = TinyConvEncoder().eval(), AudioSource(Recipe())
    report = build(data, enc, cache=tmp_path / "store", workers=0)
    assert report.encoded == 0  # a rebuild hashes nothing and reads no input
    for name, parts in stored_features(tmp_path / "store", report.root).items():
        with torch.no_grad():
            live = enc(src.load(data / name).unsqueeze(0))[0]
        torch.testing.assert_close(parts[""], live, rtol=1e-5, atol=1e-6)


def test_held_bytes_count_one_object_kept_under_many_rows_once() -> None:
    """An object's bytes moved to its rows (a recording's segments) count once against the
    budget, and are uncounted when the last row takes them (checked against a plain model)."""
    import random

    from featbake.encode.fingerprints import HeldBytes

    rng = random.Random(0)
    held = HeldBytes(budget=1000)
    model: dict[str, bytes] = {}
    for step in range(400):
        op = rng.choice(["keep", "share", "take", "keep_only"])
        name = f"o{rng.randrange(6)}"
        if op == "keep":
            data = bytes(rng.randrange(1, 300))
            kept = held.keep(name, data)
            live = {id(v): len(v) for v in model.values()}  # a name kept again: checked first
            assert kept == (sum(live.values()) + len(data) <= 1000)
            if kept:
                model[name] = data
        elif op == "share":
            rows = [f"{name}:{i}" for i in range(rng.randrange(4))]
            held.share(name, rows)
            if name in model:
                data = model.pop(name)
                model.update(dict.fromkeys(rows, data))
        elif op == "take":
            key = rng.choice([*model, name])
            assert held.take(key) == model.pop(key, None)
        else:
            keep = set(rng.sample(sorted(model), len(model) // 2))
            held.keep_only(keep)
            model = {k: v for k, v in model.items() if k in keep}
        assert len(held) == len(model), step
        assert held.size == sum({id(v): len(v) for v in model.values()}.values()), step
    held.clear()
    assert (len(held), held.size) == (0, 0)


def _first_build_reading(manifest: Path, enc: nn.Module, tmp_path: Path) -> tuple[BuildReport, int]:
    """A first build of ``manifest`` into ``tmp_path / "store"`` and the bytes this process read
    for it (a warm-up build into another store first: imports and loaders made once)."""
    build(manifest, enc, cache=tmp_path / "warm", workers=0)
    before = _read_so_far()
    report = build(manifest, enc, cache=tmp_path / "store", workers=0)
    return report, _read_so_far() - before


def test_a_first_build_of_a_manifest_of_whole_files_reads_each_file_once(tmp_path: Path) -> None:
    """A manifest's whole-file rows were hashed from the file, then decoded from it again (2x
    the data read); now hashed from bytes kept for decoding, so ~1.0x, one file named by two
    rows included (its bytes kept once, for both). Every stored feature is the encoder's now."""
    import json

    data = tmp_path / "audio"
    files = write_audio_folder(data, 16, seconds=8.0, seed=4)  # 4 MiB of wav
    size = sum(p.stat().st_size for p in files)
    rows = [{"id": f"c{i}", "path": f"audio/{p.name}", "label": i} for i, p in enumerate(files)]
    rows.append({"id": "again", "path": f"audio/{files[0].name}"})  # a second row, one file
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))

    enc = TinyConvEncoder().eval()
    report, read = _first_build_reading(manifest, enc, tmp_path)
    assert report.ok and (report.encoded, report.duplicates) == (16, 1)
    print(f"manifest: read {read:,} bytes for {size:,} bytes of inputs ({read / size:.2f}x)")
    assert read < 1.25 * size, (read, size)  # ~1.0x (2.0x before)

    src = AudioSource(Recipe())
    stored = stored_features(tmp_path / "store", report.root)
    assert list(stored) == [r["id"] for r in rows]
    for row in rows:
        with torch.no_grad():
            live = enc(src.load(tmp_path / row["path"]).unsqueeze(0))[0]
        torch.testing.assert_close(stored[row["id"]][""], live, rtol=1e-5, atol=1e-6)


def test_a_file_named_whole_and_by_segments_is_read_once(tmp_path: Path) -> None:
    """A local file named by a whole-file row and by segment rows was hashed streamed, then
    read whole again for its whole-file row and in part again for each segment (~2.5x the data
    here); now its bytes are kept from the hashing and all its rows decode from them (its
    segments' bounds checked from them too): ~1.0x. Every stored feature is the encoder's now."""
    import json

    from featbake.encode.sources import Span

    data = tmp_path / "audio"
    files = write_audio_folder(data, 8, seconds=8.0, seed=5)  # 2 MiB of wav
    size = sum(p.stat().st_size for p in files)
    rows: list[dict[str, object]] = []
    for i, p in enumerate(files):
        rows.append({"id": f"w{i}", "path": f"audio/{p.name}"})
        rows.append({"id": f"a{i}", "path": f"audio/{p.name}", "start": 0.5, "end": 2.5})
        rows.append({"id": f"b{i}", "path": f"audio/{p.name}", "start": 4.0, "end": 6.0})
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))

    enc = TinyConvEncoder().eval()
    report, read = _first_build_reading(manifest, enc, tmp_path)
    assert report.ok and report.encoded == len(rows)
    print(
        f"whole + segments: read {read:,} bytes for {size:,} bytes of inputs ({read / size:.2f}x)"
    )
    assert read < 1.25 * size, (read, size)  # ~1.0x (~2.5x before)

    src = AudioSource(Recipe())
    stored = stored_features(tmp_path / "store", report.root)
    assert list(stored) == [r["id"] for r in rows]
    for row in rows:
        file = tmp_path / str(row["path"])
        span = Span(float(row["start"]), float(row["end"]), None) if "start" in row else None
        with torch.no_grad():
            live = enc(src.load_span(file, span).unsqueeze(0))[0]
        torch.testing.assert_close(stored[str(row["id"])][""], live, rtol=1e-5, atol=1e-6)
