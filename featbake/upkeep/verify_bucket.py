"""``featbake verify`` on a bucket store: the bucket's own objects, checked from any node.

Every shard the newest catalog version names must be an object in the bucket whose bytes hash to
its name and pass their header and checksums. Each object is downloaded into the tier's
``tmp/verify/`` (one at a time, deleted after its check), never read from the tier's copy: a
tier holding a good copy of a shard says nothing about the object other nodes fetch. Shard
objects no kept version names are a note (gc removes them after ``--retention``). Repair is not
done on a bucket: the report names each damaged or missing object and what to do (delete it,
build again: a build encodes what a missing shard held).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from featbake.errors import ConfigError
from featbake.progress import GcProgress
from featbake.store.layout import Layout, RemotePlace
from featbake.store.open import describe
from featbake.store.remote.store import catalog_shards
from featbake.upkeep.verify_checks import check_shard
from featbake.upkeep.verify_findings import Finding, FindingKind, VerifyReport, VerifyStatus

Progress = Callable[[GcProgress], None] | None


def refuse_bucket_repair(layout: Layout) -> None:
    """Raise: ``verify --repair`` is built for a local store only.

    Raises:
        ConfigError: always, with what to do instead.
    """
    raise ConfigError(
        f"--repair is not built for a bucket store ({describe(layout)}); run `featbake verify "
        "--cache URL` to list damaged or missing shard objects, delete a damaged object, then "
        "build again (a build encodes again what a missing shard held)"
    )


def verify_bucket(layout: Layout, progress: Progress = None) -> VerifyReport:
    """Check every shard object the newest version names (see the module docstring).

    Raises:
        StoreError: the bucket cannot be read.
    """
    place = layout.remote
    if place is None:
        raise ConfigError(f"{layout.root} is not a bucket store")
    t0 = time.perf_counter()
    named = catalog_shards(layout.catalog)
    listed = place.shard_objects()
    report = VerifyReport(describe(layout), VerifyStatus.CLEAN, 0, 0, [])
    scratch = layout.tmp / "verify"
    try:
        for i, name in enumerate(sorted(named)):
            finding = _check_object(place, scratch, name, name in listed)
            if finding is None:
                report.shards_checked += 1
                report.bytes_checked += listed[name]
            else:
                report.findings.append(finding)
            if progress:
                progress(GcProgress("verify", i + 1, len(named)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    unnamed = sorted(set(listed) - set(named))
    if unnamed:
        report.findings.append(
            Finding(
                FindingKind.ORPHAN_SHARD,
                f"{len(unnamed)} shard objects",
                "no catalog version names them; gc deletes them once older than --retention",
                False,
            )
        )
    report.remaining = [f for f in report.findings if f.damage]
    report.status = VerifyStatus.DAMAGED if report.remaining else VerifyStatus.CLEAN
    report.seconds = time.perf_counter() - t0
    return report


def _check_object(place: RemotePlace, scratch: Path, name: str, listed: bool) -> Finding | None:
    """The finding for shard object ``name`` (None when it is sound)."""
    where = place.shard_where(name)
    if not listed:
        return Finding(
            FindingKind.MISSING_SHARD,
            where,
            "the catalog names it, the bucket has no such object; build again to encode what "
            "it held",
            True,
        )
    path = scratch / name[:2] / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        place.download_shard(name, path)
    except FileNotFoundError:
        return Finding(FindingKind.MISSING_SHARD, where, "deleted while verify ran", True)
    try:
        check = check_shard(path)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if check.sound:
        return None
    return Finding(
        FindingKind.CORRUPT_SHARD,
        where,
        f"{check.problem}; delete this object, then build again (a build encodes what it held)",
        True,
    )
