"""The PUTs and bytes of one build's fragments into a bucket: 50 inputs, one shard each, into
moto's S3 server on loopback (``featbake build --shard-size 1KiB --batch-size 1``), each PUT
counted at the byte seam (``S3Objects.put``) with the size of what it uploads.

    python benchmarks/run.py fragment_puts
    python benchmarks/bench_fragment_puts.py --inputs 200

Run it with ``PYTHONPATH`` at another tree (``git archive <commit> featbake``) for a before.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _rows import row

from featbake.cli import main as cli_main
from featbake.store.objects import S3Objects
from featbake.testing import TinyConvEncoder, save_torchscript, start_moto, write_audio_folder


def run(inputs: int) -> list[dict]:
    """The build's PUTs, counted: one row per measure."""
    tmp = Path(tempfile.mkdtemp())
    server = start_moto(tmp / "access.log")
    try:
        server.make_bucket("fbbench")
        os.environ.update({**server.env, "FEATBAKE_LOCAL_CACHE": str(tmp / "tier")})
        data = tmp / "clips"
        write_audio_folder(data, inputs, seconds=(0.2, 0.4), seed=11)
        encoder = save_torchscript(TinyConvEncoder(), tmp / "enc.pt")
        puts: list[tuple[str, int]] = []
        real = S3Objects.put

        def put(self: S3Objects, name: str, src: Path, *, create: bool) -> None:
            puts.append((name, Path(src).stat().st_size))
            real(self, name, src, create=create)

        S3Objects.put = put  # type: ignore[method-assign]
        args = ["build", "-e", str(encoder), "-d", str(data), "--cache", "s3://fbbench/store"]
        try:
            cli_main([*args, "--workers", "0", "--shard-size", "1KiB", "--batch-size", "1"])
        except SystemExit as e:
            if e.code:
                raise
        frag = [size for name, size in puts if name.startswith("fragments/")]
        shards = sum(1 for name, _ in puts if name.startswith("shards/"))
        note = (
            f"{inputs} inputs, one shard each, into moto's S3 on loopback: {shards} shard PUTs, "
            f"{len(puts)} PUTs in all; the fragments' bytes {sum(frag):,} (largest {max(frag):,})"
        )
        bound = 2 + shards.bit_length()
        return [
            row(
                "fragment_puts",
                "fragment PUTs per build",
                len(frag),
                "PUTs",
                f"<= {bound} (log of shards)",
                len(frag) <= bound,
                note,
            ),
            row(
                "fragment_puts",
                "fragment bytes / the largest fragment",
                sum(frag) / max(frag),
                "x",
                f"<= {bound}x",
                sum(frag) <= bound * max(frag),
                note,
            ),
        ]
    finally:
        server.stop()


def main(quick: bool = False) -> list[dict]:
    return run(20 if quick else 50)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=50)
    for r in run(parser.parse_args().inputs):
        print(f"{r['metric']}: {r['value']:g} {r['unit']} (target {r['target']}); {r['note']}")
