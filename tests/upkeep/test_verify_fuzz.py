"""Bounded fuzz of what verify reads: shard headers and the catalog file (issue 11, item 16).

Whatever bytes hypothesis puts there, ``verify`` and ``verify --repair`` either return a report
or raise a :class:`FeatbakeError` (one clear line in the CLI): never another exception, never a
hang (each example runs under an alarm). The examples are fixed (derandomized) so a failure
reproduces; to hunt for new ones run with ``FEATBAKE_FUZZ_EXAMPLES=300`` (random examples).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from featbake.errors import FeatbakeError
from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder
from featbake.upkeep import VerifyReport, verify
from tests.helpers import bake, shard_files

EXAMPLE_TIMEOUT_S = 20

FUZZ = settings(
    max_examples=int(os.environ.get("FEATBAKE_FUZZ_EXAMPLES", "40")),
    deadline=None,
    derandomize=not os.environ.get("FEATBAKE_FUZZ_EXAMPLES"),  # fixed examples unless hunting
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def base_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real store (4 clips, several shards), its catalog checkpointed into one file."""
    tmp = tmp_path_factory.mktemp("fuzzbase")
    encoder = save_torchscript(TinyConvEncoder(), tmp / "encoder.pt")
    write_audio_folder(tmp / "audio", 4, seconds=(0.3, 0.6), seed=3)
    store = tmp / "store"
    bake(tmp / "audio", encoder, store, shard_bytes=20_000)
    with sqlite3.connect(store / "catalog.sqlite") as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return store


@contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def hang(*_: object) -> None:
        raise TimeoutError(f"verify did not finish within {seconds}s (a hang)")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _survives(base: Path, damage: Callable[[Path], None]) -> None:
    """Damage a copy of ``base``; verify, repair and verify again may only report or refuse."""
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store"
        shutil.copytree(base, store)
        damage(store)
        with _alarm(EXAMPLE_TIMEOUT_S):
            for repair in (False, True, False):
                try:
                    report = verify(store, repair_damage=repair)
                except FeatbakeError:
                    continue
                assert isinstance(report, VerifyReport)
                assert report.exit_code in (0, 10, 11)


def _split(path: Path) -> tuple[int, bytes, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n], raw[8 + n :]


def _write(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@FUZZ
@given(
    which=st.integers(0, 99),
    mode=st.sampled_from(["bytes", "document", "entry", "length"]),
    at=st.lists(st.tuples(st.integers(0, 2**31), st.binary(min_size=1, max_size=4)), max_size=6),
    value=JSON,
    length=st.integers(0, 2**64 - 1),
)
def test_fuzzed_shard_headers_never_crash_verify(
    base_store: Path,
    which: int,
    mode: str,
    at: list[tuple[int, bytes]],
    value: object,
    length: int,
) -> None:
    def damage(store: Path) -> None:
        files = sorted(shard_files(store))
        path = files[which % len(files)]
        n, head, data = _split(path)
        if mode == "bytes":  # random bytes over the JSON header
            buf = bytearray(head)
            for pos, chunk in at:
                i = pos % len(buf)
                buf[i : i + len(chunk)] = chunk
            _write(path, bytes(buf[:n]), data)
        elif mode == "document":  # the whole header replaced by some JSON value
            _write(path, json.dumps(value).encode(), data)
        elif mode == "entry":  # one entry (a tensor's or __metadata__) replaced
            doc = json.loads(head)
            names = sorted(doc)
            doc[names[which % len(names)]] = value
            _write(path, json.dumps(doc).encode(), data)
        else:  # a length prefix that lies
            path.write_bytes(struct.pack("<Q", length) + head + data)

    _survives(base_store, damage)


@FUZZ
@given(
    at=st.lists(
        st.tuples(st.integers(0, 2**31), st.binary(min_size=1, max_size=64)), min_size=1, max_size=8
    )
)
def test_fuzzed_catalog_bytes_never_crash_verify(
    base_store: Path, at: list[tuple[int, bytes]]
) -> None:
    def damage(store: Path) -> None:
        path = store / "catalog.sqlite"
        buf = bytearray(path.read_bytes())
        for pos, chunk in at:
            i = pos % len(buf)
            buf[i : i + len(chunk)] = chunk
        path.write_bytes(bytes(buf))

    _survives(base_store, damage)
