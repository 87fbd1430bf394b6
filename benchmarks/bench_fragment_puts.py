"""The PUTs and bytes of one build's fragments into a bucket: 50 inputs, one shard each, into
moto's S3 server on loopback (``featbake build --shard-size 1KiB --batch-size 1``), each PUT
counted at the byte seam (``S3Objects.put``) with the size of what it uploads.

    python benchmarks/bench_fragment_puts.py [--inputs 50]

Run it with ``PYTHONPATH`` at another tree (``git archive <commit> featbake``) for a before.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from featbake.cli import main
from featbake.store.objects import S3Objects
from featbake.testing import TinyConvEncoder, save_torchscript, start_moto, write_audio_folder


def run(inputs: int) -> None:
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
            main([*args, "--workers", "0", "--shard-size", "1KiB", "--batch-size", "1"])
        except SystemExit as e:
            if e.code:
                raise
        frag = [size for name, size in puts if name.startswith("fragments/")]
        shards = sum(1 for name, _ in puts if name.startswith("shards/"))
        print(
            f"{inputs} inputs: {shards} shard PUTs; {len(frag)} fragment PUTs, {sum(frag):,} "
            f"bytes (largest {max(frag):,}); {len(puts)} PUTs in all"
        )
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=50)
    run(parser.parse_args().inputs)
