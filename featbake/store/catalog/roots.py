"""Roots: their catalog rows and their ``roots/<name>.json`` manifest files.

A root's row and items are written in ONE place (:func:`write_root_rows`), inside the same write
transaction as its manifest file, so two builds of one root cannot leave them disagreeing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.catalog.connection import CatalogConnection, Transaction
from featbake.store.catalog.rows import Root, RootItem, RootSpec, columns
from featbake.store.fidelity import fidelity_file
from featbake.store.layout import Layout, checked_root_name, fsync_dir

#: The latest last use of a root's features. Serving records use per feature (coarsely, see
#: serve/lastuse.py), never per root: this is how a root a dataset reads counts as used.
ROOT_READ_SELECT = (
    "SELECT max(f.last_used) FROM root_items ri JOIN features f ON f.key = ri.key WHERE ri.root=?"
)

ROOT_FORMAT = "featbake-root"
ROOT_FORMAT_VERSION = 1
ROOT_SELECT = f"SELECT {', '.join(Root.COLUMNS)} FROM roots"
ITEMS_SELECT = f"SELECT {columns(RootItem)} FROM root_items WHERE root=? ORDER BY idx"


def roots_dir(layout: Layout) -> Path:
    """``<store>/roots``: one JSON manifest per root, so roots survive the loss of the catalog."""
    return layout.roots


def root_file(layout: Layout, name: str) -> Path:
    return roots_dir(layout) / f"{checked_root_name(name)}.json"


def items_file(layout: Layout, name: str) -> Path:
    """``roots/<name>.items``: items appended to a root's manifest since its file was written
    whole (one ``[path, key]`` JSON array per line), so that extending a root costs what is
    added, not the whole manifest. Read with the manifest; gone when the file is written whole.
    """
    return roots_dir(layout) / f"{checked_root_name(name)}.items"


def tombstone_file(layout: Layout, name: str) -> Path:
    """Left by a root drop while it runs; a crash leaves it for gc to finish the drop."""
    return roots_dir(layout) / f"{checked_root_name(name)}.dropped"


def root_payload(root: Root, items: Sequence[tuple[str, str]]) -> dict:
    """The JSON document of a root manifest file."""
    return {
        "format": ROOT_FORMAT,
        "format_version": ROOT_FORMAT_VERSION,
        "name": root.name,
        "data": root.data,
        "encoder_label": root.encoder_label,
        "encoder_fp": root.encoder_fp,
        "recipe_fp": root.recipe_fp,
        "recipe": root.recipe,
        "created": root.created,
        "last_used": root.last_used,
        "items": [[p, k] for p, k in items],
    }


def write_root_file(layout: Layout, root: Root, items: Sequence[tuple[str, str]]) -> Path:
    """Write a root's manifest file durably (tmp, fsync, rename, fsync dir) and drop its tombstone.

    Raises:
        StoreError: the store is not writable.
    """
    final = root_file(layout, root.name)
    tmp = layout.tmp / f"root-{uuid.uuid4().hex}.part"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        layout.tmp.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(root_payload(root, items), f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        # The whole manifest holds the appended items now. (A crash before this unlink leaves
        # them twice: verify reports the file stale and --repair rewrites it; none is lost.)
        for stale in (items_file(layout, root.name), tombstone_file(layout, root.name)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        fsync_dir(final.parent)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise StoreError(
            f"could not write the root manifest {final}: {e.strerror or e}; "
            "check that the cache directory is writable and has space"
        ) from e
    return final


def append_root_items(layout: Layout, name: str, items: Sequence[tuple[str, str]]) -> None:
    """Append ``items`` to root ``name``'s manifest durably (write, fsync), in its ``.items``
    file. Called inside the transaction that adds their rows, as the whole file is.

    Raises:
        StoreError: the store is not writable.
    """
    path = items_file(layout, name)
    try:
        created = not path.exists()
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps([p, k], separators=(",", ":")) + "\n" for p, k in items))
            f.flush()
            os.fsync(f.fileno())
        if created:
            fsync_dir(path.parent)
    except OSError as e:
        raise StoreError(
            f"could not append to the root manifest {path}: {e.strerror or e}; "
            "check that the cache directory is writable and has space"
        ) from e


def _appended_items(path: Path) -> list[RootItem]:
    """The items of a manifest's ``.items`` file; a last line cut short by a crash (written
    before its transaction committed, so never in the catalog) is ignored."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # only lines that were ended
    return [RootItem(str(p), str(k)) for p, k in map(json.loads, lines)]


def read_root_file(path: Path) -> tuple[Root, list[RootItem]]:
    """Parse a root manifest file (and the items appended to it since, in its ``.items``).

    Raises:
        StoreCorrupt: the file is not a readable featbake root manifest.
    """
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != ROOT_FORMAT:
            raise ValueError("not a featbake root manifest")
        items = [RootItem(str(p), str(k)) for p, k in doc["items"]]
        items += _appended_items(path.with_suffix(".items"))
        root = Root(
            name=doc["name"],
            data=doc["data"],
            encoder_label=doc["encoder_label"],
            encoder_fp=doc["encoder_fp"],
            recipe_fp=doc["recipe_fp"],
            recipe=doc["recipe"],
            items=len(items),
            created=float(doc["created"]),
            last_used=float(doc["last_used"]),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreCorrupt(
            f"root manifest {path} is unreadable ({e}); `featbake verify --repair` moves it to "
            "quarantine/, and rebuilding that data folder publishes the root again"
        ) from e
    return root, items


def write_root_rows(
    c: Transaction,
    root: Root,
    items: Sequence[tuple[str, str]],
    *,
    first: int = 0,
    indices: Sequence[int] | None = None,
) -> None:
    """Write a root's row, and ``items`` as its items from index ``first`` on (the only writer
    of both; ``first`` > 0 appends to the items already there). ``indices`` gives each item's
    index instead (a rank's fragment holds its slice of the whole build's manifest)."""
    c.execute(
        f"INSERT OR REPLACE INTO roots({', '.join(Root.COLUMNS)}) VALUES (?,?,?,?,?,?,?,?,?)",
        root.row(),
    )
    where = range(first, first + len(items)) if indices is None else indices
    c.executemany(
        "INSERT INTO root_items(root, idx, path, key) VALUES (?,?,?,?)",
        [(root.name, i, p, k) for i, (p, k) in zip(where, items, strict=True)],
    )


def _named_keys(c: Transaction, name: str, keys: Sequence[str]) -> set[str]:
    """Which of ``keys`` root ``name`` names already (through the key index: no item scan)."""
    named: set[str] = set()
    for s in range(0, len(keys), 500):  # well under SQLite's bound on parameters
        chunk = keys[s : s + 500]
        marks = ",".join("?" * len(chunk))
        rows = c.execute(
            f"SELECT key FROM root_items WHERE key IN ({marks}) AND root=?", (*chunk, name)
        )
        named.update(k for (k,) in rows)
    return named


class RootRows(CatalogConnection):
    """Roots and their manifests: reading them, publishing them (builds, datasets,
    CachedEncoder: never a delete of features) and dropping them (gc, ``featbake roots drop``)."""

    def root(self, name: str) -> Root | None:
        """The root named ``name``, or None."""
        row = self.conn.execute(f"{ROOT_SELECT} WHERE name=?", (name,)).fetchone()
        return Root.from_row(row) if row else None

    def roots(self) -> list[Root]:
        """Every root, most recently built first."""
        rows = self.conn.execute(f"{ROOT_SELECT} ORDER BY last_used DESC").fetchall()
        return [Root.from_row(r) for r in rows]

    def root_items(self, name: str) -> list[RootItem]:
        """A root's manifest: (relative path, key) in file order."""
        return [RootItem._make(r) for r in self.conn.execute(ITEMS_SELECT, (name,))]

    def with_reads(self, root: Root) -> Root:
        """``root`` with ``last_used`` the later of its build (or publish) and the last read
        of any of its features, so ``gc --older-than`` keeps a root a dataset reads.

        A feature several roots name counts for each (a read of it is a use of them all).
        """
        read = self.conn.execute(ROOT_READ_SELECT, (root.name,)).fetchone()[0] or 0.0
        return dataclasses.replace(root, last_used=max(root.last_used, read))

    # -- publishing ----------------------------------------------------------------------------

    def replace_root(
        self, spec: RootSpec, items: Sequence[tuple[str, str]], now: float | None = None
    ) -> None:
        """Replace root ``spec.name``'s manifest with ``items`` ((relative path, key), in
        order)."""
        now = time.time() if now is None else now
        name = spec.name
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            root = spec.root(len(items), old[0] if old else now, now)
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            write_root_rows(c, root, items)
            # The manifest file is what `verify --repair` rebuilds roots from (roots are not in
            # shards). Written while this transaction holds the write lock, so two builds of one
            # root cannot leave the file and the row disagreeing.
            write_root_file(self.layout, root, items)

    def extend_root(self, spec: RootSpec, keys: Sequence[str], now: float | None = None) -> int:
        """Append ``keys`` not yet named to root ``name`` (made if absent); returns how many.

        For writers with no data folder to rebuild a manifest from (``CachedEncoder``): what
        they store stays reachable, so gc keeps it until the root is dropped (``featbake roots
        drop`` or ``gc --older-than``). Items get an empty path. Call it before
        :meth:`add_shard` for those keys, so gc never sees their rows unreached. Its cost is
        that of the keys added: they are looked up through the key index and appended to the
        manifest's ``.items`` file (fsynced, inside the transaction), never the whole manifest
        read or rewritten (which made a CachedEncoder's write-back quadratic in its root).

        Example:
            >>> spec = RootSpec("cached-encoder-3f1c", "cached-encoder:3f1c", "MyEncoder",
            ...     fp, rfp, {})  # doctest: +SKIP
            >>> cat.extend_root(spec, ["9a..."])  # doctest: +SKIP
        """
        now = time.time() if now is None else now
        name = spec.name
        wanted = list(dict.fromkeys(keys))
        with self.transaction() as c:
            old = c.execute("SELECT created FROM roots WHERE name=?", (name,)).fetchone()
            named = _named_keys(c, name, wanted) if old is not None else set()
            new = [RootItem("", k) for k in wanted if k not in named]
            if old is not None and not new:
                c.execute("UPDATE roots SET last_used=? WHERE name=?", (now, name))
                return 0
            first = c.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM root_items WHERE root=?", (name,)
            ).fetchone()[0]
            root = spec.root(first + len(new), old[0] if old else now, now)
            write_root_rows(c, root, new, first=first)
            if first and root_file(self.layout, name).exists():
                append_root_items(self.layout, name, new)  # what was added, not the manifest
            else:  # a new root (or its file lost): the whole manifest, once
                items = [RootItem._make(r) for r in c.execute(ITEMS_SELECT, (name,))]
                write_root_file(self.layout, root, items)
        return len(new)

    # -- dropping ------------------------------------------------------------------------------

    def drop_root(
        self,
        name: str,
        *,
        unused_before: float | None = None,
        between: Callable[[str], None] | None = None,
    ) -> bool:
        """Drop root ``name`` (row, manifest and file); returns False if it was not dropped.

        Order: inside one write transaction the manifest file is renamed to a tombstone
        (``roots/<name>.dropped``), then the rows go; after COMMIT the tombstone is unlinked. A
        crash leaves either the root intact with a tombstone beside it (gc finishes the drop) or
        no root and a tombstone (gc unlinks it); never a root whose manifest file is lost.
        ``unused_before`` drops it only if it was not built or read since then (a build that
        refreshed it, or a dataset that read its features, meanwhile wins). ``between`` is a
        test hook called between the steps.
        """
        live, dead = root_file(self.layout, name), tombstone_file(self.layout, name)
        with self.transaction() as c:
            row = c.execute("SELECT last_used FROM roots WHERE name=?", (name,)).fetchone()
            if row is None or (unused_before is not None and row[0] >= unused_before):
                return False
            read = c.execute(ROOT_READ_SELECT, (name,)).fetchone()[0] or 0.0
            if unused_before is not None and read >= unused_before:
                return False  # read since the plan: still in use
            if live.exists():
                os.replace(live, dead)
                fsync_dir(live.parent)
            if between:
                between("drop-root-renamed")
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            c.execute("DELETE FROM roots WHERE name=?", (name,))
            if between:
                c.after_commit(lambda: between("drop-root-committed"))
            c.after_commit(lambda: unlink_quietly(dead))
            c.after_commit(lambda: unlink_quietly(items_file(self.layout, name)))
            c.after_commit(lambda: unlink_quietly(fidelity_file(self.layout, name)))
        return True

    def finish_drop(self, name: str) -> bool:
        """Finish a drop that a crash interrupted (a tombstone is left); True if rows went.

        If the root was built again since (its manifest file is back), only the tombstone goes.
        """
        dead = tombstone_file(self.layout, name)
        if root_file(self.layout, name).exists():
            unlink_quietly(dead)
            return False
        with self.transaction() as c:
            c.execute("DELETE FROM root_items WHERE root=?", (name,))
            dropped = c.execute("DELETE FROM roots WHERE name=?", (name,)).rowcount > 0
            c.after_commit(lambda: unlink_quietly(dead))
            c.after_commit(lambda: unlink_quietly(items_file(self.layout, name)))
            c.after_commit(lambda: unlink_quietly(fidelity_file(self.layout, name)))
        return dropped


def unlink_quietly(path: Path) -> None:
    """Remove a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
