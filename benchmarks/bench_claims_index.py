"""gc's claims step after many claims were made and let go (``claims/index``'s growth).

Makes N claims the way ``ClaimFile`` does to the index (the claim file published, its name
logged with ``log_claim``, the file removed at its release; fsync left out: it is not what is
measured), keeps one claim live, then times gc's claims step once: ``claims.lock`` held alone,
``claimed_keys(drop_stale=True)`` (every indexed name looked up, the index rewritten). Run it
in two trees to compare:

    chrt -f 10 python benchmarks/bench_claims_index.py [N]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from _rows import row

from featbake.store import claims
from featbake.store.layout import Layout


def made_and_let_go(layout: Layout, n: int) -> None:
    """``n`` claims published, logged and removed, as a claim's life leaves the index."""
    folder = claims.claims_dir(layout)
    folder.mkdir(parents=True, exist_ok=True)
    with mock.patch.object(os, "fsync", lambda fd: None), claims.claims_held(layout, shared=True):
        for _ in range(n):
            path = claims.new_claim_path(layout)
            path.write_text('{"format": "featbake-claim", "host": "h", "pid": 1}\n')
            claims.log_claim(layout, path.name)
            path.unlink()


def gc_claims_step(n: int) -> tuple[int, float]:
    """The names left in the index after ``n`` claims came and went (one still live), and the
    seconds gc's claims step took over them."""
    with tempfile.TemporaryDirectory() as tmp:
        layout = Layout(Path(tmp))
        live = claims.ClaimFile(layout, "live")
        live.cover(["k" * 64])
        made_and_let_go(layout, n)
        lines = len(claims.indexed_names(layout))
        t0 = time.perf_counter()
        with claims.claims_closed(layout):
            kept = claims.claimed_keys(layout, drop_stale=True)
        took = time.perf_counter() - t0
        live.release()
    assert kept == {"k" * 64}
    return lines, took


def main(quick: bool = False, n: int | None = None) -> list[dict]:
    """``make bench``'s rows: the index's names and gc's claims step after ``n`` claims."""
    n = n or (10_000 if quick else 100_000)
    lines, took = gc_claims_step(n)
    note = f"{n:,} claims made and let go, one live"
    return [
        row("claims_index", "names left in claims/index", lines, "names", note=note),
        row("claims_index", "gc's claims step", took * 1e3, "ms", note=note),
    ]


if __name__ == "__main__":
    for r in main(n=int(sys.argv[1]) if len(sys.argv) > 1 else None):
        print(f"{r['metric']}: {r['value']:.1f} {r['unit']} ({r['note']})")
