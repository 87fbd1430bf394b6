"""``featbake verify`` on a bucket store: every shard the newest catalog version names is in
the bucket and its bytes pass their checksums.

Each shard is fetched through the store's local tier, which checks every tensor's CRC before
it keeps a file (and fetches once more before it calls an object damaged), so a verify also
warms the tier, within its budget. Repair is not done on a bucket: a damaged or missing shard
is reported with what to do (delete the object, build again: a build encodes what a missing
shard held).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from featbake.errors import StoreCorrupt
from featbake.store.remote.store import SHARDS, BucketStore, catalog_shards

#: verify's exit code when damage remains (as ``featbake verify`` without --repair).
DAMAGE_EXIT = 11


@dataclass
class BucketVerifyReport:
    """What verify found in a bucket store: shards checked, and those missing or damaged."""

    version: int = 0
    shards_checked: int = 0
    bytes_checked: int = 0
    missing: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    unnamed: int = 0  # shard objects no version names (gc removes them after --retention)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not (self.missing or self.damaged)

    @property
    def exit_code(self) -> int:
        return 0 if self.clean else DAMAGE_EXIT

    def to_json(self) -> dict:
        return {**asdict(self), "status": "clean" if self.clean else "damaged"}


def verify_bucket(
    store: BucketStore, progress: Callable[[int, int], None] | None = None
) -> BucketVerifyReport:
    """Check every shard the newest version names (see the module docstring).

    Raises:
        StoreError: the bucket cannot be read.
    """
    t0 = time.perf_counter()
    report = BucketVerifyReport(version=store.local_version())
    named = set(catalog_shards(store.layout.catalog))
    listed = {
        o.name.rsplit("/", 1)[-1].removesuffix(".safetensors"): o for o in store.bucket.list(SHARDS)
    }
    report.unnamed = len(set(listed) - named)
    for i, name in enumerate(sorted(named)):
        obj = listed.get(name)
        if obj is None:
            report.missing.append(name)
        else:
            try:
                store.fetch_shard(name)
                report.shards_checked += 1
                report.bytes_checked += obj.size
            except StoreCorrupt:
                report.damaged.append(name)
        if progress:
            progress(i + 1, len(named))
    report.seconds = time.perf_counter() - t0
    return report
