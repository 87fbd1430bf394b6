"""A root and its files under ``roots/``: the manifest, its appended items, a drop's tombstone,
and the record of the inputs its last build could not decode.

A root is a named manifest: the keys one build of (data, encoder, recipe) produced, in file
order. Its rows live in the catalog (:class:`featbake.store.catalog.RootRows`, which writes this
module's files inside the transaction that writes the rows); its files here are what
``verify --repair`` rebuilds the rows from, so roots survive the loss of the catalog:

```
roots/<name>.json         the manifest, written whole (ROOT_FORMAT)
roots/<name>.items        items appended since, one [path, key] JSON array per line
roots/<name>.dropped      left by a drop while it runs; gc finishes a drop a crash cut short
roots/<name>.undecodable  the inputs the last build could not decode (key -> reason)
roots/<name>.held         the table rows a dataset kept in the root but did not serve
roots/<name>.fidelity     what an int8/fp8 build measured (featbake.store.fidelity)
roots/<name>.<part>.padding  what a build (part) that may pad set out to encode, until its end
```
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from featbake.errors import StoreCorrupt, StoreError
from featbake.store.files import fsync_dir, publish_file
from featbake.store.layout import Layout, checked_root_name


class RootItem(NamedTuple):
    """One item of a root's manifest: the input's path (relative to the data folder) and key."""

    path: str
    key: str


@dataclass(frozen=True)
class RootSpec:
    """What a root is a build of: its name, data folder, encoder and recipe (a ``roots`` row
    without its counts and times), and where its data's relative paths were taken from
    (:attr:`Root.workdir`). Every writer of roots takes one."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    workdir: str = ""

    def root(self, items: int, created: float, last_used: float) -> Root:
        """The ``roots`` row of this spec with ``items`` items."""
        return Root(
            self.name, self.data, self.encoder_label, self.encoder_fp, self.recipe_fp,
            self.recipe, items, created, last_used, self.workdir,
        )  # fmt: skip


@dataclass(frozen=True)
class Root:
    """A named manifest: the keys one build of (data, encoder, recipe) produced, in file order.

    ``workdir`` is the folder the data's relative paths were taken from, where its readers take
    them from the working directory (a Kaldi folder's ``wav.scp``, a lhotse cut manifest's
    sources, as Kaldi and lhotse do): the build's working directory. Reopening the data (the
    export's check, a repair's re-keying, an engine's worker) takes them from there, not from
    wherever it runs. ``""`` for data whose paths do not depend on it (a folder, a manifest's
    paths relative to its own folder) and for a root recorded before it was kept (its data is
    read from the working directory, as it always was)."""

    name: str
    data: str
    encoder_label: str
    encoder_fp: str
    recipe_fp: str
    recipe: dict
    items: int
    created: float
    last_used: float
    workdir: str = ""

    #: The ``roots`` table's columns, in the order :meth:`row` gives them.
    COLUMNS = (
        "name",
        "data",
        "encoder_label",
        "encoder_fp",
        "recipe_fp",
        "recipe",
        "items",
        "created",
        "last_used",
        "workdir",
    )

    def row(self) -> tuple[Any, ...]:
        """The values of :attr:`COLUMNS` (the recipe as canonical JSON)."""
        return (
            self.name,
            self.data,
            self.encoder_label,
            self.encoder_fp,
            self.recipe_fp,
            json.dumps(self.recipe, sort_keys=True),
            self.items,
            self.created,
            self.last_used,
            self.workdir,
        )

    @classmethod
    def from_row(cls, values: Any) -> Root:
        """A root from the values of a ``SELECT`` of :attr:`COLUMNS`, matched by name.

        SQLite keeps whatever a column is given, so each value is checked for its type (a
        catalog edited by hand or damaged inside a page that still reads).

        Raises:
            StoreCorrupt: a value is not of its column's kind (the recipe not a JSON object,
                a count or a time not a number); the message says to run verify --repair.
        """
        row = dict(zip(cls.COLUMNS, values, strict=True))
        try:
            root = cls(
                name=_text(row["name"]),
                data=_text(row["data"]),
                encoder_label=_text(row["encoder_label"]),
                encoder_fp=_text(row["encoder_fp"]),
                recipe_fp=_text(row["recipe_fp"]),
                recipe=_json_object(row["recipe"]),
                items=_count(row["items"]),
                created=_time(row["created"]),
                last_used=_time(row["last_used"]),
                workdir=_text(row["workdir"]),
            )
        except (TypeError, ValueError, RecursionError) as e:
            raise StoreCorrupt(
                f"the catalog's row of root {str(row['name'])[:80]!r} is damaged ({e}); run "
                "`featbake verify --repair` to rebuild it from the root manifests"
            ) from None
        return root


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r:.40} is not text")
    return value


def _json_object(value: Any) -> dict:
    recipe = json.loads(_text(value))
    if not isinstance(recipe, dict):
        raise TypeError("its recipe is not a JSON object")
    return recipe


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{value!r:.40} is not a count")
    return value


def _time(value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise TypeError(f"{value!r:.40} is not a time")
    return float(value)


ROOT_FORMAT = "featbake-root"
ROOT_FORMAT_VERSION = 1


def roots_dir(layout: Layout) -> Path:
    """``<store>/roots``: one JSON manifest per root, so roots survive the loss of the catalog.

    Raises:
        StoreError: ``roots`` is there and is not a folder (a file, a link to nothing): read as
            an empty folder, every root's manifest would look gone, and no manifest could be
            written (the OS's "File exists" says nothing of why).
    """
    folder = layout.roots
    if os.path.lexists(folder) and not folder.is_dir():
        raise StoreError(
            f"{folder} is not a folder, where featbake keeps each root's manifest; move it "
            "aside, then run this again (`featbake verify --repair` writes the manifests anew "
            "from the catalog)"
        )
    return folder


def roots_named(name: str, names: Iterable[str]) -> list[str] | None:
    """The roots among ``names`` that ``name`` names: itself, else each it is a prefix of;
    None where it is a prefix too short to name one ("", "r", "r-": every root's).

    Example:
        >>> roots_named("r-3f", ["r-3f1c", "r-9a00"]), roots_named("r-", ["r-3f1c"])
        (['r-3f1c'], None)
    """
    names = list(names)
    if name in names:
        return [name]
    if len(name.removeprefix("r-")) < 2:
        return None
    return [n for n in names if n.startswith(name)]


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
        "workdir": root.workdir,
        "items": [[p, k] for p, k in items],
    }


def write_root_file(layout: Layout, root: Root, items: Sequence[tuple[str, str]]) -> Path:
    """Write a root's manifest file durably (:func:`publish_file`) and drop its tombstone.

    Raises:
        StoreError: the store is not writable.
    """
    final = root_file(layout, root.name)
    payload = json.dumps(root_payload(root, items), separators=(",", ":"))
    try:
        publish_file(
            final, lambda tmp: tmp.write_text(payload, encoding="utf-8"), tmp_dir=layout.tmp
        )
        # The whole manifest holds the appended items now. (A crash before this unlink leaves
        # them twice: verify reports the file stale and --repair rewrites it; none is lost.)
        # The folder was fsynced by the publish: again only if an unlink changed it since (a
        # new root's build paid a third fsync for nothing).
        unlinked = False
        for stale in (items_file(layout, root.name), tombstone_file(layout, root.name)):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
                unlinked = True
        if unlinked:
            fsync_dir(final.parent)
    except OSError as e:
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
            workdir=str(doc.get("workdir", "")),  # none in a manifest written before it was kept
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreCorrupt(
            f"root manifest {path} is unreadable ({e}); `featbake verify --repair` moves it to "
            "quarantine/, and rebuilding that data folder publishes the root again"
        ) from e
    return root, items


def published_at(layout: Layout | None, root: Root) -> float:
    """When ``root`` was last published: the time its catalog row records
    (:attr:`Root.last_used`, which travels with a bucket's catalog versions), or its manifest
    file's mtime in ``layout`` where that is earlier (a file dated back by hand). Not the
    file's alone: a bucket's fresh tier dates its copy of the manifest when it brought it in,
    and a repair writing a manifest anew dates it then, after any edit of the data since the
    build, which then read as no edit at all."""
    when = root.last_used
    with contextlib.suppress(OSError, ValueError, StoreError):
        if layout is not None:
            when = min(when, os.stat(root_file(layout, root.name)).st_mtime)
    return when


# -- the held-back record -----------------------------------------------------------------------
# The table rows a dataset kept in its root but did not serve: ``roots/<name>.held``.
#
# A table row whose clip is not found is served as built unless its table file changed since
# the build and no file its cell names is the one the hash cache keys as built (a row edited
# to name another clip): such a row keeps its key as built in the root, so gc keeps its
# features, and is not served (featbake.serve.index). Whether the table file changed is told
# by the time the root was last published (its catalog row's, which a bucket's versions carry),
# which any later publishing of the root moves (a dataset publishing another row's new key, a
# repair): so the dataset records the rows it held back, each with its key as built, before it
# publishes, and a row named here with the key its root still gives it stays held back until
# the clip its cell names is found or a build drops it. On a bucket store the record travels
# with the root: in the dataset's ``serve`` fragment, then in each catalog version
# (:data:`CARRIED_RECORDS`), so every node's tier has it. A record left by a root dropped since
# names keys a later build need not give its rows: one that does is checked by the hash cache
# as any other row is.
def held_file(layout: Layout, name: str) -> Path:
    """``roots/<name>.held``: the rows a dataset kept back (row -> its key as built)."""
    return roots_dir(layout) / f"{checked_root_name(name)}.held"


def read_held(layout: Layout, name: str) -> dict[str, str]:
    """Row -> key as built for each row of root ``name`` a dataset kept back; ``{}`` when there
    is no record or it cannot be read (the rows are then told by the table file's time)."""
    try:
        rows = json.loads(held_file(layout, name).read_text(encoding="utf-8"))["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {str(r): str(k) for r, k in rows.items()} if isinstance(rows, dict) else {}


def write_held(layout: Layout, name: str, rows: dict[str, str]) -> None:
    """Record ``rows`` (row -> key as built) as root ``name``'s rows kept back, replacing the
    record (tmp, rename); no ``rows`` removes it.

    Raises:
        StoreError: the store is not writable.
    """
    _write_record(layout, held_file(layout, name), "rows", rows, "the rows kept back")


def _write_record(
    layout: Layout, final: Path, field: str, entries: dict[str, str], what: str
) -> None:
    """Write a record beside a root (``{field: entries}``, tmp then rename), or remove it
    where ``entries`` is empty; ``what`` names it in the error.

    Raises:
        StoreError: the store is not writable.
    """
    if not entries:
        unlink_quietly(final)
        return
    _publish_record(layout, final, json.dumps({field: entries}, sort_keys=True), what)


def _publish_record(layout: Layout, final: Path, doc: str, what: str) -> None:
    """Put ``doc`` at ``final`` (its folder made, tmp then rename); ``what`` names the
    record in the error.

    Raises:
        StoreError: the store is not writable.
    """
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        publish_file(final, functools.partial(_write_utf8, doc), tmp_dir=layout.tmp)
    except OSError as e:
        raise StoreError(
            f"could not record {what} in {final}: {e.strerror or e}; check that the cache "
            "directory is writable"
        ) from e


# -- the undecodable record ---------------------------------------------------------------------
# The inputs a root's last build could not decode or encode: ``roots/<name>.undecodable``.
#
# A build skips an input it cannot decode (a text file named ``.jpg``, a corrupt wav), says so
# and exits 3; its manifest (published before encoding) still names the input's key, which is
# never stored. A dataset then left the input in, and with ``on_miss="error"`` raised a miss
# advising the build that skips it again. The record is keyed by feature key, so it names those
# bytes under that encoder and recipe only: a file fixed since hashes to another key, which the
# record does not name (the next build encodes it). A file beside the manifest, as the fidelity
# record is: written once per build, after encoding, without a schema migration; dropping the
# root removes it. A build through fragments (in parts, or into a bucket store) has each part's
# ``done`` fragment carry its own, and the merge that publishes the root writes their union
# (store/merge.py). Where the root's published state is not this folder (a bucket store, whose
# tier's ``roots/`` is never uploaded), the record travels with it: :data:`CARRIED_RECORDS`,
# read and written whole by :func:`carried_records` and :func:`restore_records` (a bucket keeps
# them inside each catalog version it publishes: store/bucket.py).
def undecodable_file(layout: Layout, name: str) -> Path:
    """``roots/<name>.undecodable`` (not ``.json``: upkeep reads every ``*.json`` as a manifest)."""
    return layout.roots / f"{checked_root_name(name)}.undecodable"


def write_undecodable(layout: Layout, name: str, failed: dict[str, str]) -> None:
    """Record ``failed`` (key -> the build's reason) for root ``name``, replacing the last
    build's record (tmp, rename); an empty ``failed`` removes it.

    Raises:
        StoreError: the store is not writable.
    """
    final = undecodable_file(layout, name)
    _write_record(layout, final, "keys", failed, "the inputs this build skipped")


def read_undecodable(layout: Layout, name: str) -> dict[str, str]:
    """Key -> reason for each input root ``name``'s last build could not decode; ``{}`` when
    there is no record (or it cannot be read: the inputs are then misses, as before)."""
    try:
        doc = json.loads(undecodable_file(layout, name).read_text(encoding="utf-8"))
        keys = doc["keys"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(keys, dict):
        return {}
    return {str(k): str(v) for k, v in keys.items()}


#: The records beside a root that travel with its published state where that is not this
#: folder (a bucket store's catalog versions): the undecodable inputs, the measured fidelity
#: and the table rows a dataset kept back.
CARRIED_RECORDS = (".undecodable", ".fidelity", ".held")


def carried_records(layout: Layout) -> dict[str, str]:
    """File name -> text of each record in ``layout``'s ``roots/`` that travels with its root's
    published state (:data:`CARRIED_RECORDS`); one that cannot be read is left out (its inputs
    are then misses, as without a record)."""
    try:
        entries = list(os.scandir(roots_dir(layout)))
    except FileNotFoundError:
        return {}
    out = {}
    for entry in entries:
        if entry.name.endswith(CARRIED_RECORDS) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                out[entry.name] = Path(entry.path).read_text(encoding="utf-8")
    return out


def carried_name(name: str) -> bool:
    """Whether ``name`` is the file name of a carried record of a root (one path component)."""
    suffix = next((s for s in CARRIED_RECORDS if name.endswith(s)), None)
    if suffix is None:
        return False
    try:
        checked_root_name(name.removesuffix(suffix))
    except StoreCorrupt:
        return False
    return True


def restore_records(layout: Layout, records: dict[str, str]) -> None:
    """Make ``layout``'s ``roots/`` hold exactly ``records`` (file name -> text) among its
    carried records: each written (tmp, rename: a reader sees the old file or the new one),
    every other carried record removed (its root's newer state has none). A name that is not a
    root's record (a damaged or planted catalog version) is passed over.

    Raises:
        StoreError: the folder is not writable.
    """
    held = carried_records(layout)
    for name in set(held) - set(records):
        unlink_quietly(layout.roots / name)
    for name, text in records.items():
        if not carried_name(name) or held.get(name) == text:
            continue
        final = layout.roots / name
        try:
            publish_file(final, functools.partial(_write_utf8, text), tmp_dir=layout.tmp)
        except OSError as e:
            raise StoreError(
                f"could not write {final}: {e.strerror or e}; check that the folder is writable"
            ) from e


def _write_utf8(text: str, path: Path) -> None:
    path.write_text(text, encoding="utf-8")


# A build that may pad its batches: ``roots/<name>.<part>.padding``, from before it encodes to
# its end (one per part of a build in parts: ``--shard``, torchrun ranks).
#
# The exactness guard checks the most padded item of each padded batch; a later batch can fail
# it after earlier batches' items were sealed, and the build then encodes those again alone
# (bake/pipeline.py). Which items those are was known only to the process that padded them: a
# build killed before that later batch left them stored, and its rerun reused them as they were
# (served off by the padding's drift) while its own check failed. So a build that may pad
# records the keys it sets out to encode before it encodes any, and whether a check failed; its
# rerun takes the keys it finds stored among them as padded (encoded again alone once a check
# fails, as the first run would have), and a build's end removes the record. Each key is
# recorded by its first :data:`PADDING_MARK` hex digits: one taken for another only costs an
# item encoded again. A bucket keeps each record as an object too (``padding/``, through the
# store's place: ``publish_padding``, ``padding_texts``, ``retire_padding``), so a rerun on any
# node reads what a part stopped on another set out to do.
PADDING_MARK = 16


@dataclass(frozen=True)
class PaddingRecord:
    """The keys an unfinished build of a root set out to encode while its batches may be
    padded (each by its first :data:`PADDING_MARK` hex digits), and whether one of its
    padding checks failed (padding is then known inexact for the encoder).

    Example:
        >>> record = PaddingRecord().with_keys(["ab" * 32])
        >>> sorted(record.suspects(["ab" * 32, "cd" * 32])) == ["ab" * 32]
        True
    """

    marks: frozenset[str] = frozenset()
    inexact: bool = False

    def with_keys(self, keys: Iterable[str]) -> PaddingRecord:
        """This record with ``keys`` added."""
        return PaddingRecord(self.marks | {k[:PADDING_MARK] for k in keys}, self.inexact)

    def joined(self, other: PaddingRecord) -> PaddingRecord:
        """This record and ``other`` together: the keys of both; inexact if either says so."""
        return PaddingRecord(self.marks | other.marks, self.inexact or other.inexact)

    def suspects(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` the record names: stored, maybe from padded batches."""
        return {k for k in keys if k[:PADDING_MARK] in self.marks}


def padding_file(layout: Layout, name: str, part: str) -> Path:
    """``roots/<name>.<part>.padding``: the record of part ``part`` (``"<rank>-of-<world>"``)
    of root ``name``'s build (see :class:`PaddingRecord`): each part keeps its own, so one
    finishing never removes another's."""
    return roots_dir(layout) / f"{checked_root_name(name)}.{part}.padding"


def read_padding(layout: Layout, name: str, part: str | None = None) -> PaddingRecord:
    """Part ``part``'s padding record of root ``name``, or (``part`` None) every part's
    together; an empty one where there is none (or it cannot be read: the build before it
    then left nothing known, as before the record)."""
    if part is not None:
        return _read_padding_file(padding_file(layout, name, part))
    try:
        paths = sorted(roots_dir(layout).glob(f"{checked_root_name(name)}.*.padding"))
    except OSError:
        return PaddingRecord()
    records = [_read_padding_file(p) for p in paths]
    marks = frozenset().union(*(r.marks for r in records))
    return PaddingRecord(marks, any(r.inexact for r in records))


def _read_padding_file(path: Path) -> PaddingRecord:
    try:
        return padding_of([path.read_text(encoding="utf-8")])
    except OSError:
        return PaddingRecord()


def padding_of(texts: Iterable[str]) -> PaddingRecord:
    """The padding records written as ``texts`` (:func:`write_padding`'s), together; one that
    cannot be read adds nothing (the build before it then left nothing known, as before the
    record)."""
    marks: set[str] = set()
    inexact = False
    for text in texts:
        try:
            doc = json.loads(text)
            got, failed = doc["marks"], doc["inexact"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(got, list):
            marks.update(str(m) for m in got)
            inexact = inexact or failed is True
    return PaddingRecord(frozenset(marks), inexact)


def write_padding(layout: Layout, name: str, part: str, record: PaddingRecord) -> Path:
    """Record ``record`` for part ``part`` of root ``name``'s build (tmp, rename, durable:
    written before any feature it names is sealed); the file written.

    Raises:
        StoreError: the store is not writable.
    """
    final = padding_file(layout, name, part)
    doc = json.dumps({"inexact": record.inexact, "marks": sorted(record.marks)})
    _publish_record(layout, final, doc, "what this build encodes")
    return final


def clear_padding(layout: Layout, name: str, part: str) -> None:
    """Remove part ``part``'s padding record of root ``name``: that part came to its end."""
    unlink_quietly(padding_file(layout, name, part))


def unlink_quietly(path: Path) -> None:
    """Remove a file that may already be gone."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
