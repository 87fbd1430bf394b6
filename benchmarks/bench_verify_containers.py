"""``verify`` over a store built from one webdataset tar of many small members: the time to
check the hash cache's member rows, which must grow linearly with the members (each tar opened
and listed once), not quadratically (the tar reopened, and its headers parsed again, per row).

    python benchmarks/bench_verify_containers.py [--quick] [N ...]   (default 500 2000; quick 200)

Each size builds its own store (a tiny TorchScript encoder over 0.05 s clips, not timed),
waits out the hash cache's racy window so every row is trusted, then times ``verify`` whole
and its hash-cache check alone.
"""

from __future__ import annotations

import io
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import soundfile
from _rows import row

from featbake.bake.pipeline import build
from featbake.store.layout import Layout
from featbake.testing import TinyConvEncoder, make_tone, save_torchscript
from featbake.upkeep import verify
from featbake.upkeep.check import check_hash_cache


def write_shard(path: Path, n: int) -> Path:
    """A tar of ``n`` samples, each a 0.05 s wav and a small text member."""
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            out = io.BytesIO()
            soundfile.write(out, make_tone(0.05, 16000, seed=i), 16000, format="WAV")
            for name, data in ((f"u{i:06d}.wav", out.getvalue()), (f"u{i:06d}.txt", b"w")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def measure(n: int) -> tuple[float, float, int]:
    """(verify seconds, hash-cache check seconds, rows checked) for a shard of ``n`` members."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        encoder = save_torchscript(TinyConvEncoder(), root / "encoder.pt")
        tar = write_shard(root / "shard.tar", n)
        time.sleep(1.1)  # past the racy window: every row is trusted, so every row is checked
        report = build(tar, encoder, cache=root / "store", workers=0)
        assert report.encoded == n and not report.failed, report.failed
        t0 = time.perf_counter()
        assert verify(root / "store").status == "clean"
        whole = time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = check_hash_cache(Layout(root / "store")).files_read
        return whole, time.perf_counter() - t0, rows


def main(quick: bool = False, sizes: list[int] | None = None) -> list[dict]:
    """One row per size: ``verify``'s seconds, with the hash-cache check's in the note, and the
    target that the check stays linear (per row no slower at the largest size than 2x the
    smallest's)."""
    sizes = sizes or ([200] if quick else [500, 2000])
    rows, per_row = [], []
    for n in sizes:
        whole, check, checked = measure(n)
        per_row.append(check / max(checked, 1))
        linear = per_row[-1] <= 2 * per_row[0] + 1e-4
        note = f"hash-cache check {check:.2f} s for {checked} member rows"
        rows.append(row("verify", f"verify, a tar of {n:,} members", whole, "s",
                        "linear in members", linear, note))  # fmt: skip
    return rows


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--quick"]
    for r in main("--quick" in sys.argv, [int(a) for a in args] or None):
        print(f"{r['metric']}: {r['value']:.2f} s ({r['note']})")
