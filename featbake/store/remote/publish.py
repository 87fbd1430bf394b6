"""Merging into a bucket store: fold its fragments into the next catalog version and publish it.

The tier's catalog is never written in place (readers of this node may have it open): the merge
runs on a copy in ``tmp/merge-<id>/``, folds every fragment the bucket holds (the local merge,
:func:`featbake.store.merge.merge`, unchanged), and publishes the result as version N+1 only if
nobody published N+1 first (``If-None-Match: *``). A merge that loses that race starts again
from the newer version: folding is idempotent (first row wins, a root's newer manifest wins).
Only after the version is published are the folded fragments deleted from the bucket, so a
merge killed at any moment loses nothing: its rerun folds them again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import Callable

from featbake.errors import StoreError
from featbake.store.fragments import fragments_dir, sealed_fragments
from featbake.store.layout import Layout
from featbake.store.merge import MergeReport, merge
from featbake.store.remote.store import FRAGMENTS, BucketStore
from featbake.store.remote.versions import version_name

#: A test hook: called with the name of each step a merge finished.
Between = Callable[[str], None] | None

#: Merges that lose the race for the next version before one gives up.
TRIES = 5


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
    for _ in range(TRIES):
        version = store.sync_catalog()
        store.sync_fragments()
        work = Layout(store.layout.tmp / f"merge-{uuid.uuid4().hex[:12]}", remote=store)
        try:
            published = _merge_and_publish(store, work, version, between)
        finally:
            shutil.rmtree(work.root, ignore_errors=True)
        if published is not None:
            return published
    raise StoreError(
        f"other merges published {TRIES} catalog versions of {store} while this one ran; run "
        "`featbake merge` again when they are done"
    )


def _merge_and_publish(
    store: BucketStore, work: Layout, version: int, between: Between
) -> MergeReport | None:
    """Merge on ``work`` (a copy of version ``version``); the report, or None if another merge
    published ``version + 1`` first."""
    work.ensure()
    if store.layout.catalog.exists():
        shutil.copyfile(store.layout.catalog, work.catalog)
    here = fragments_dir(store.layout)
    fragments_dir(work).mkdir()
    folding = {f.path.name for f in sealed_fragments(store.layout)}
    for name in folding:
        os.link(here / name, fragments_dir(work) / name)
    report = merge(work, between=between)
    left = {f.path.name for f in sealed_fragments(work)}
    folded = folding - left
    if not folded:
        return report
    _standalone(work)
    if not store.bucket.upload(version_name(version + 1), work.catalog, create=True):
        return None
    if between:
        between("published")
    store.bucket.delete(f"{FRAGMENTS}{name}" for name in folded)
    for name in folded:
        with contextlib.suppress(OSError):
            (here / name).unlink()
    _keep_roots(work, store.layout)
    store.install_catalog(work.catalog, version + 1)
    return report


def _standalone(work: Layout) -> None:
    """Make the merged catalog one self-contained file (no WAL beside it) before its upload."""
    conn = sqlite3.connect(work.catalog)
    try:
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()


def _keep_roots(work: Layout, tier: Layout) -> None:
    """Move the root manifests the merge wrote into the tier (they go with its catalog)."""
    if not work.roots.is_dir():
        return
    tier.roots.mkdir(parents=True, exist_ok=True)
    for f in work.roots.iterdir():
        os.replace(f, tier.roots / f.name)
