"""Publishing a bucket store's next catalog version: merges and gc go through here.

The tier's catalog is never written in place (readers of this node may have it open): a change
runs on a copy in ``tmp/work-<id>/`` (:func:`publish_next`), and the result is published as
version N+1 only if nobody published N+1 first (``If-None-Match: *``). A change that loses
that race starts again from the newer version: merging is idempotent (first row wins, a root's
newer manifest wins), and gc re-plans. What a change retires in the bucket (folded fragments)
is deleted only after the version is published, so a merge killed at any moment loses
nothing: its rerun folds them again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from featbake.errors import StoreError
from featbake.store.catalog.connection import open_sqlite
from featbake.store.fragments import fragments_dir, sealed_fragments
from featbake.store.layout import Layout
from featbake.store.merge import MergeReport, merge
from featbake.store.remote.store import FRAGMENTS, BucketStore
from featbake.store.remote.versions import version_name

T = TypeVar("T")


class DamagedFragmentWarning(UserWarning):
    """A build fragment in a bucket cannot be read: it was left unmerged (named, with what to
    do), and every other build merged."""


#: A test hook: called with the name of each step a merge finished.
Between = Callable[[str], None] | None

#: Changes that lose the race for the next version before one gives up.
TRIES = 5


@dataclass
class Change(Generic[T]):
    """What a change made of a work copy: its report, whether the catalog changed (else
    nothing is published), and what to do once the new version is published."""

    value: T
    changed: bool
    after_publish: Callable[[], None] | None = None


def publish_next(store: BucketStore, change: Callable[[Layout], Change[T]]) -> T:
    """Apply ``change`` to a copy of the newest version and publish it as the next one.

    Raises:
        StoreError: the bucket cannot be read or written, or others kept publishing first.
    """
    for _ in range(TRIES):
        version = store.sync_catalog()
        work = Layout(store.layout.tmp / f"work-{uuid.uuid4().hex[:12]}", remote=store)
        try:
            work.ensure()
            if store.layout.catalog.exists():
                shutil.copyfile(store.layout.catalog, work.catalog)
            outcome = change(work)
            if not outcome.changed:
                return outcome.value
            _standalone(work)
            if store.bucket.upload(version_name(version + 1), work.catalog, create=True):
                if outcome.after_publish:
                    outcome.after_publish()
                _keep_roots(work, store.layout)
                store.install_catalog(work.catalog, version + 1)
                return outcome.value
        finally:
            shutil.rmtree(work.root, ignore_errors=True)
    raise StoreError(
        f"other merges or gc runs published {TRIES} catalog versions of {store} while this one "
        "ran; run it again when they are done"
    )


def merge_store(layout: Layout) -> MergeReport:
    """Merge the store ``layout`` is: a bucket store's next version, or a local catalog."""
    if isinstance(layout.remote, BucketStore):
        return merge_bucket(layout.remote)
    return merge(layout)


def merge_bucket(store: BucketStore, *, between: Between = None) -> MergeReport:
    """Fold the bucket's fragments into a new catalog version (see the module docstring).

    ``between`` is a test hook, called with the local merge's steps, then ``published``.

    Raises:
        StoreError: the bucket cannot be read or written, or others kept publishing first.
    """

    def fold(work: Layout) -> Change[MergeReport]:
        store.sync_fragments()
        here = fragments_dir(store.layout)
        fragments_dir(work).mkdir()
        folding = {f.path.name for f in sealed_fragments(store.layout)}
        for name in folding:
            os.link(here / name, fragments_dir(work) / name)
        report = merge(work, between=between, skip_damaged=True)
        folded = folding - {f.path.name for f in sealed_fragments(work)}
        for name in report.damaged:
            warnings.warn(
                f"the build fragment {store.bucket.where(FRAGMENTS + name)} is damaged and was "
                "not merged (everything else was); delete that object and rerun the part that "
                "wrote it: it encodes again what the fragment named",
                DamagedFragmentWarning,
                stacklevel=2,
            )

        def retire() -> None:
            if between:
                between("published")
            store.bucket.delete(f"{FRAGMENTS}{name}" for name in folded)
            for name in folded:
                with contextlib.suppress(OSError):
                    (here / name).unlink()

        return Change(report, bool(folded), retire)

    return publish_next(store, fold)


def _standalone(work: Layout) -> None:
    """Make the new catalog one self-contained file (no WAL beside it) before its upload."""
    conn = open_sqlite(work.catalog)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def _keep_roots(work: Layout, tier: Layout) -> None:
    """Move the root manifests the change wrote into the tier (they go with its catalog)."""
    if not work.roots.is_dir():
        return
    tier.roots.mkdir(parents=True, exist_ok=True)
    for f in work.roots.iterdir():
        os.replace(f, tier.roots / f.name)
