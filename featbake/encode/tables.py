"""Tables as a build's inputs (issue 29 item 3): parquet files and Hugging Face datasets saved
to disk, each row one item.

A :class:`Table` is an :class:`featbake.encode.inputs.Inputs` behind the same seam as a folder:
the build and the dataset ask it for the items (in the table's order), each item's full name,
its digest through the hash cache, and a source that decodes it. An item is named
``<file>:<row>`` (``/data/train.parquet:12``), and its digest is the SHA-256 of the cell's
bytes, so the same image as a file and as a parquet cell has the same key and is stored once.

**Hash cache.** An item's entry is keyed by its full name and column, compared on its file's
stat (size, mtime, inode, ctime), as a file's is: a rebuild over unchanged files reads no cell
(their ids are read). Entries follow git's "racy" rule as files do (see ``FileStat.racy``).

**Decoding** reads the cell (its row group, kept while the next rows are decoded) and hands the
bytes to the recipe's source. The file's stat must still be the one the digest was taken with,
or the item fails as a file changed mid-build does.

**A datasets Audio column's declared decoding** (``cast_column("audio",
Audio(sampling_rate=8000))``, ``num_channels``), read from ``dataset_info.json`` or the files'
``huggingface`` metadata, is what the user's ``datasets`` loader gives for each row: an audio
recipe of another rate or channel layout is said in a note (the build's ``note:`` line, a
dataset's warning at its first live encoding) naming the ``--sample-rate`` (or ``--mono``)
that matches (:class:`DeclaredAudio`). Not refused: a Hub dataset declares its files' own
rate (Common Voice: 48 kHz) where a training loop casts it to the encoder's, as this build
resamples it.

**Path-only cells.** ``Dataset.to_parquet`` (and ``save_to_disk``) of a dataset made from local
files (``cast_column("audio", Audio())`` over paths) writes each Audio/Image cell as
``{"bytes": null, "path": "clips/a.wav"}``; ``datasets`` then reads the file at the path when it
decodes the row (``Audio.decode_example``: no bytes, a local path, the file opened as named, so a
relative path from the working directory). A local table's such cell is read from that file:
its path absolute as written, a relative one taken from the working directory first (where
``datasets`` reads it) and, where no file is there, from the table file's own folder (where a
table written beside its clips, ``data.parquet`` next to ``clips/``, keeps working from any
directory; huggingface/datasets#7313). Its key is the file's SHA-256, as the same file's in a
folder, through the hash cache by the file's own path and stat (a clip rewritten behind an
unchanged table is read again: no stale digest), and it is decoded from that file, checked
unchanged since it was hashed. A path that names no file is a bad row naming the path, where
it was looked for, and the row. A bucket's table's path-only cells are refused (bad rows).

The working directory a build took relative paths from is recorded in its root
(:attr:`featbake.store.roots.Root.workdir`, :attr:`Table.found_in`), as a Kaldi folder's and
lhotse cuts' are: a rebuild opened from another directory takes them from there first, then
from the table's folder, then from its own working directory (:attr:`Table.build_workdir`,
:class:`CellPaths`); a dataset from there and the table's folder only (a clip in neither is
gone: :attr:`Table.reads_here`); a table opened again as built (an export's check) from
there, then the table's folder; an engine's worker from the driver's places, in its order
(:meth:`Table.take_paths_as`). So other files of the same relative names in another working
directory are not read in place of the ones built. The working directory is read only for a
relative path-only cell (:attr:`Table.here`).

**Bad rows**: a null cell, a cell with neither bytes nor a path, a path-only cell whose file is
missing, a table file whose column holds neither bytes nor an Audio/Image struct; each is one
line naming the file and row, skipped, and the build exits 3.

The bytes are read by the store's one table reader (``featbake.store.containers.TableFile``,
which ``verify`` reads them with too) through the byte seam (``featbake.store.byteplace``: a
local file, or a parquet object by ranged GETs); this module turns what it reads into items,
digests through the hash cache, and tensors.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import io
import json
import os
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple, cast
from urllib.parse import urlparse

from featbake.encode.fingerprints import (
    Digester,
    HeldBytes,
    ItemRef,
    containers_of,
    digest_here,
    hash_inputs,
    hash_listed,
)
from featbake.encode.sources import ScanResult, SkippedInput, Source
from featbake.errors import SourceError, first_line
from featbake.progress import Progress
from featbake.recipe import Recipe
from featbake.store.byteplace import Whole, bytes_at, object_head
from featbake.store.containers import (
    ARROW_READ_ERRORS,
    CellKind,
    Holder,
    ReadBack,
    TableFile,
    cell_bytes,
    cell_digests,
    cell_kind,
    path_only_cell,
    pyarrow_module,
    refuse_mixed_schemas,
    replaced_files,
    split_item_path,
)
from featbake.store.hash_cache import FileStat, HashCache, HashRow
from featbake.store.objects import object_stat

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

#: The hash-cache id prefix of a bucket's parquet file: its schema and row ids (see
#: :meth:`Table._listing`).
TABLE_PREFIX = "table-rows:"


# Parquet files (one, or a folder of them) and Hugging Face datasets saved with
# ``save_to_disk`` (a folder of Arrow IPC *stream* files ``data-*.arrow`` listed in ``state.json``,
# beside ``dataset_info.json``), read with pyarrow, never through the ``datasets`` package. Each row
# is an item; ``--column`` names the cell to encode: an Audio or Image column (a struct of
# ``bytes`` and ``path``, as the Hub stores them) or a binary column. An item's id is its ``id``
# column when the table has one, else ``<file>:<row>``; its other columns are carried.
def hf_features(schema: pa.Schema) -> dict[str, Any]:
    """column -> its ``datasets`` feature (``{"_type": "Audio", "sampling_rate": 8000}``) as
    the schema's ``huggingface`` metadata records it (written by ``datasets`` and the Hub in
    parquet and Arrow files); empty where there is none."""
    meta = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(meta)["info"]["features"] if meta else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}


def hf_feature_types(schema: pa.Schema) -> dict[str, str]:
    """column -> the ``datasets`` feature type (``Audio``, ``Image``, ``Value``) recorded in the
    schema's ``huggingface`` metadata (written by ``datasets`` and the Hub), where there is one."""
    features = hf_features(schema)
    return {k: v.get("_type", "") for k, v in features.items() if isinstance(v, dict)}


def saved_features(folder: str) -> dict[str, Any] | None:
    """column -> its feature as a local ``save_to_disk`` folder's ``dataset_info.json`` records
    it (what ``load_from_disk`` decodes by, over the Arrow files' own metadata), or None where
    the folder has none (a parquet folder, a bucket) or it cannot be read."""
    try:
        with open(os.path.join(folder, "dataset_info.json"), encoding="utf-8") as f:
            features = json.load(f).get("features")
    except (OSError, ValueError, AttributeError):
        return None
    return features if isinstance(features, dict) else None


@dataclass(frozen=True)
class DeclaredAudio:
    """What a ``datasets`` Audio column says its rows decode to: ``cast_column("audio",
    Audio(sampling_rate=8000))`` makes ``datasets`` resample every row to 8 kHz, so a build at
    another rate would encode samples the user's loader never gives. ``rate`` None: the file's
    own; ``mono`` True: mixed to one channel (``num_channels=1``, or an older ``datasets``'s
    ``mono: true``), False: channels kept (``num_channels`` 2 or more, ``mono: false``), None:
    not declared (``datasets`` 4's default: the file's channels)."""

    column: str
    rate: int | None
    mono: bool | None

    @classmethod
    def of(cls, features: Mapping[str, Any], column: str) -> DeclaredAudio | None:
        """The declaration of ``column`` among ``features``; None where it is no Audio column
        or declares neither a rate nor channels."""
        feature = features.get(column)
        if not isinstance(feature, Mapping) or feature.get("_type") != "Audio":
            return None
        rate = _count(feature.get("sampling_rate"))
        channels, mono = _count(feature.get("num_channels")), feature.get("mono")
        if channels is not None:
            mono = channels == 1
        mono = mono if isinstance(mono, bool) else None
        return None if rate is None and mono is None else cls(column, rate, mono)

    def mismatch(self, recipe: Recipe, where: str) -> str | None:
        """Why ``recipe`` would not encode what ``datasets`` gives for this column's rows, in one
        line saying what to pass instead; None where it would."""
        named = f"column {self.column!r} of {where} is a datasets Audio column"
        if self.rate is not None and self.rate != recipe.sample_rate:
            return (
                f"{named} of {self.rate} Hz (datasets decodes each row at {self.rate} Hz), "
                f"and this build resamples it to {recipe.sample_rate} Hz: where your loader "
                f"feeds the encoder the rows as datasets decodes them, pass --sample-rate "
                f"{self.rate}; where it casts them to {recipe.sample_rate} Hz, this is that"
            )
        if self.mono is not None and self.mono != recipe.mono:
            said = "mixed to one channel" if self.mono else "with its channels kept"
            ours = "mixes them to one" if recipe.mono else "keeps them (--no-mono)"
            fix = "drop --no-mono" if self.mono else "pass --no-mono"
            return (
                f"{named} decoded {said}, and this build {ours}: where your loader feeds the "
                f"encoder the rows as datasets decodes them, {fix}"
            )
        return None


def _count(value: Any) -> int | None:
    """``value`` where it is a positive whole number (a rate, a channel count), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def is_table(where: str) -> bool:
    """Whether ``--data`` names a table: a ``.parquet`` file, a ``save_to_disk`` folder (or a
    DatasetDict's, refused with its splits named), or a folder of parquet files only."""
    if where.lower().endswith((".parquet", ".arrow")):
        return True
    return bytes_at(where).is_table_folder(where)


class Row(NamedTuple):
    """Where an item of a table lives: its file (index into the table's files) and row."""

    file: int
    row: int


class Table:
    """A table's rows as a build's inputs (an ``Inputs``): see the section's comment.

    Args:
        data: a ``.parquet`` file, a folder of them, or a folder ``save_to_disk`` wrote.
        column: the column to encode; None: the first Audio/Image (by the source's kind) or
            bytes column.
        workdir: the folder path-only cells' relative paths are taken from first: a root's
            record of its build's (:attr:`featbake.store.roots.Root.workdir`) where the table
            is opened again as built (an export's check); ``""``: the working directory now,
            as ``datasets`` opens them.
    """

    #: Each file the hash cache does not know may be read by any process (an engine's task),
    #: by the scan's column and kinds: ``hash``'s ``digester`` (see ``inputs.digested_anywhere``).
    hashed_anywhere: ClassVar[bool] = True

    def __init__(self, data: str, column: str | None = None, workdir: str = "") -> None:
        pyarrow_module()
        #: The build's folder the table was opened with (``workdir``; ``""``: none given).
        self.given = workdir
        self.workdir_recorded = bool(workdir)  # a build's, not this process's own
        #: This process's working directory, read when a path-only cell first needs it
        #: (:attr:`here`): a bucket's table, or one opened from a deleted directory, never does.
        self._here = ""
        #: The folder the table's last build took relative paths from, where a dataset or a
        #: rebuild opens it from another working directory (set before the scan): taken from
        #: there first, so the rows are read from the files their build read, not from other
        #: files of the same relative names here (:attr:`cell_paths`).
        self.build_workdir = ""
        #: Whether a relative path found neither in :attr:`build_workdir` nor beside the table
        #: is looked for in this process's working directory: a rebuild's is (as ``datasets``
        #: would read it); a dataset's is not (:func:`~featbake.encode.inputs.read_as_built`):
        #: that clip is gone, not another file of the same name here.
        self.reads_here = True
        #: where the last scan's relative paths were found (:attr:`found_in`)
        self.taken = TakenFrom()
        #: a bucket's parquet file -> its stat, and the listings to record (see :meth:`_listing`)
        self.listed: dict[str, FileStat] = {}
        self.known: HashCache | None = None
        self.fresh: list[HashRow] = []
        self.place = bytes_at(data)
        self.where = self.place.resolve(data)
        #: the notes of the files' listing (folders it could not read), said by each scan
        self.notes: list[str] = []
        self.files = self.place.table_files(self.where, self.notes)
        # A folder's (a prefix's) file names are relative to it: ``out.parquet`` may name one
        # object or, in a bucket, the prefix Spark writes (which table_files told).
        self.folder = (
            self.where
            if any(f.path != self.where for f in self.files)
            else self.place.table_folder(self.where)
        )
        self.column = column
        self.kinds: list[CellKind] = []  # per file
        self.text = False  # the source is text: the column holds strings (set by the scan)
        self.items: dict[str, Row] = {}  # id -> where, in the table's order
        #: file index -> its path-only cells' paths by row (:meth:`_paths_named`), per scan
        self._named: dict[int, dict[int, str]] = {}
        self.positions: dict[str, int] = {}  # file path -> its index (see file_index)
        #: a local file -> its stat when the scan read its rows (None: it changed meanwhile):
        #: the version each id's row is of, which hashing and decoding check (carried into
        #: decode workers, which open the file afresh: see :meth:`replaced`)
        self.scanned: dict[str, FileStat | None] = {}
        #: what the column's ``datasets`` feature declares its rows decode to (set by the scan)
        self.declared: DeclaredAudio | None = None
        #: the recipe the source decodes by (set by :meth:`source`): checked against
        #: :attr:`declared` by whichever of the scan and :meth:`source` comes second
        self.recipe: Recipe | None = None

    @property
    def stat_tells_change(self) -> bool:
        return False  # an item's stat is its file's: revalidate cannot stat a row

    @property
    def paths_from_workdir(self) -> bool:
        """Whether the table takes relative paths from a working directory: a local table's
        path-only cells may name them (a bucket's are refused; a text column names none)."""
        return not self.remote and not self.text

    @property
    def here(self) -> str:
        """This process's working directory (read once, when first asked)."""
        if not self._here:
            self._here = os.getcwd()
        return self._here

    @property
    def workdir(self) -> str:
        """The working directory path-only cells' relative paths are taken from (see
        :class:`CellPaths`): the build's folder the table was opened with, else this
        process's."""
        return self.given or self.here

    @property
    def cell_paths(self) -> CellPaths:
        """Where path-only cells' relative paths are taken from: the build's working directory
        given by :attr:`build_workdir` first (the working directory now last, where
        :attr:`reads_here`), else :attr:`workdir`."""
        build = self.build_workdir
        if build and not self.workdir_recorded and build != self.here:
            return CellPaths(build, SAID_BUILD, self.here if self.reads_here else "")
        return CellPaths(self.workdir, SAID_BUILD if self.workdir_recorded else SAID_HERE)

    @property
    def paths_taken(self) -> tuple[str, str]:
        """(this process's working directory, :attr:`build_workdir`): what a process that
        opens the table again takes its relative paths as (:meth:`take_paths_as`); ``("",
        "")`` where no relative path-only cell needed the working directory."""
        return (self._here, self.build_workdir) if self._here else ("", "")

    def take_paths_as(self, here: str, build_workdir: str) -> None:
        """Take path-only cells' relative paths from the places a process run in ``here``,
        given ``build_workdir`` (:attr:`paths_taken`), takes them from, in its order: an
        engine's worker, opened in a working directory of its own, reads the files the
        build's process hashed (a new row's clip found only in that process's directory
        too)."""
        self.given, self.workdir_recorded = "", False
        self._here, self.build_workdir = here, build_workdir

    @property
    def found_in(self) -> str:
        """The folder the last scan's relative paths were taken from, for its root to record
        (:attr:`featbake.store.roots.Root.workdir`): the working directory now where every one
        found was found only from there (a build's folder no longer holds them), else
        :attr:`CellPaths.workdir` (kept where none was found: a dataset run while the clips
        are away does not lose the build's record); ``""`` where no cell named a relative path
        (bytes, absolute paths: nothing depends on the working directory)."""
        taken = self.taken
        if not taken.relative or not self.paths_from_workdir:
            return ""  # the working directory is not read: it may be gone
        paths = self.cell_paths
        return paths.here if taken.here and not taken.workdir else paths.workdir

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The rows of every file, in order, with ids; rows that cannot be items are set aside.

        Raises:
            SourceError: no file has the column (or a column of bytes to choose), or two rows
                share an id.
        """
        listings = [self._listing(f) for f in self.files]
        self.scanned = {f.path: f.stat() for f in self.files if not f.remote}
        self.taken = TakenFrom()
        schemas = [schema for schema, _ in listings]
        named = [(self.rel_file(f), s) for f, s in zip(self.files, schemas, strict=True)]
        refuse_mixed_schemas(self.where, named)  # one table: its files hold the same columns
        self.text = ".txt" in extensions  # the text source's: each cell is a text
        self.column = self.column or self.default_column(schemas, extensions)
        self.kinds = [
            cell_kind(s.field(self.column).type, self.text)
            if self.column in s.names
            else CellKind.OTHER
            for s in schemas
        ]
        if all(k is CellKind.OTHER for k in self.kinds):
            raise SourceError(self.no_column(schemas))
        self.declared = None if self.text else self.declared_audio(schemas[0])
        note = self.declared_note()
        if note is not None and note not in self.notes:
            self.notes.append(note)  # a build: its source was made before its scan
        skipped: list[SkippedInput] = []
        seen: dict[str, str] = {}
        self.items = {}  # a scan starts afresh
        self._named = {}
        for i, (f, (schema, ids)) in enumerate(zip(self.files, listings, strict=True)):
            why = self._unusable(schema, self.kinds[i])
            for row, ident in enumerate(ids):
                name = f"{f.path}:{row}"
                if why is not None:
                    skipped.append(SkippedInput(f"{self.rel_file(f)}:{row}", why))
                elif ident in seen:
                    raise SourceError(
                        f"two rows have the id {ident!r}: {seen[ident]} and {name}; ids must be "
                        "unique (fix the id column, or drop it to name rows <file>:<row>)"
                    )
                else:
                    seen[ident] = name
                    self.items[ident] = Row(i, row)
        return ScanResult(list(self.items), skipped, tuple(self.notes))

    @property
    def remote(self) -> bool:
        """Whether the table is a parquet file in a bucket."""
        return self.place.versioned

    def _listing(self, f: TableFile) -> tuple[pa.Schema, list[str]]:
        """(schema, each row's id) of one file: an object's from the hash cache when its (size,
        last change, ETag) is the one recorded there (a row ``table-rows:<url>``: the schema
        as Arrow IPC in base64 and the ids, as JSON), else read (footer and ``id`` column, by
        ranged GETs) and recorded by :meth:`hash`.

        Raises:
            SourceError: the file (object) is missing or not a readable table file.
        """
        if not self.remote:
            return self._read_listing(f)
        st, f.headed = f.headed, None  # the listing's HEAD, taken once: a rescan asks again
        if st is None:
            info = object_head(f.path)
            if info is None:
                raise SourceError(f"{f.path}: object not found")
            st = object_stat(info)
        self.listed[f.path] = st
        f.size, pa = st.size, pyarrow_module()
        cache_id = TABLE_PREFIX + f.path
        hit = self.known.cached_hashes([cache_id]).get(cache_id) if self.known else None
        if hit is not None and hit.stat == st:
            try:
                held = json.loads(hit.sha256)
                raw = base64.b64decode(held["schema"])
                f.known_schema = pa.ipc.read_schema(pa.py_buffer(raw))
                return f.known_schema, [str(i) for i in held["ids"]]
            except (ValueError, KeyError, TypeError):
                pass  # not a listing: read the file again
        schema, ids = self._read_listing(f)
        if f.stat() != st:  # the footer and ids came from another version than the HEAD's
            raise SourceError(f"{f.path}: changed while featbake was reading it; rerun the build")
        text = base64.b64encode(schema.serialize().to_pybytes()).decode()
        self.fresh.append(HashRow(cache_id, st, json.dumps({"schema": text, "ids": ids})))
        return schema, ids

    def _read_listing(self, f: TableFile) -> tuple[pa.Schema, list[str]]:
        """(schema, each row's id) read from the file: a footer or an ``id`` column pyarrow
        cannot read is one line naming the file, not an internal error (a corrupt page of the
        ids raises pyarrow's OSError from the column read, after the footer read well)."""
        try:
            schema = f.schema()
            return schema, self._ids(f, schema)
        except ARROW_READ_ERRORS as e:
            raise SourceError(
                f"{f.path}: not a readable parquet or arrow file ({first_line(e)}); "
                "replace or remove it"
            ) from e

    def rel_file(self, f: TableFile) -> str:
        return os.path.relpath(f.path, self.folder)

    def _ids(self, f: TableFile, schema: pa.Schema) -> list[str]:
        """Each row's id: its ``id`` cell as text, else ``<file>:<row>``."""
        if "id" not in schema.names:
            return [f"{self.rel_file(f)}:{row}" for row in range(f.rows())]
        values = [v for _, chunk in f.column("id") for v in chunk.to_pylist()]
        return [
            f"{self.rel_file(f)}:{row}" if v is None else str(v) for row, v in enumerate(values)
        ]

    def _unusable(self, schema: pa.Schema, kind: CellKind) -> str | None:
        if self.column not in schema.names:
            return f"no column {self.column!r} in this file (it has {', '.join(schema.names)})"
        if kind is CellKind.OTHER:
            held = schema.field(self.column).type
            if self.text:
                return f"column {self.column!r} holds {held}, not text (a string column)"
            return (
                f"column {self.column!r} holds {held}, neither bytes nor an Audio/Image struct "
                "({bytes, path})"
            )
        return None

    def default_column(self, schemas: Sequence[pa.Schema], extensions: Sequence[str]) -> str:
        """The column to encode when none is named: the first whose Hugging Face feature type
        is the source's (Audio for audio, Image for image), else the first of bytes.

        Raises:
            SourceError: no column holds bytes: name one with --column.
        """
        schema = schemas[0] if schemas else None
        if schema is None:
            raise SourceError(f"{self.where}: no data file (parquet or arrow) found")
        wanted = "Image" if ".jpg" in extensions else "Audio"
        typed = hf_feature_types(schema)
        media = [
            n
            for n in schema.names
            if cell_kind(schema.field(n).type, self.text) is not CellKind.OTHER
        ]
        for name in media:
            if typed.get(name) == wanted or (self.text and name == "text"):
                return name
        if media:
            return media[0]
        raise SourceError(self.no_column(schemas))

    def no_column(self, schemas: Sequence[pa.Schema]) -> str:
        """Why the table has nothing to encode: the asked column is missing or holds no bytes
        in any file, or (none asked) no column holds bytes."""
        names = sorted({n for s in schemas for n in s.names})
        listed = f"(columns: {', '.join(names)})"
        held = "text (a string column)" if self.text else "bytes or an Audio/Image struct"
        if self.column is None:
            what = f"no column of {self.where} holds {held} {listed}"
        elif self.column not in names:
            what = f"{self.where} has no column {self.column!r} {listed}"
        elif self.text:
            what = f"column {self.column!r} of {self.where} holds no {held} {listed}"
        else:
            what = (
                f"column {self.column!r} of {self.where} holds neither bytes nor an Audio/Image "
                f"struct ({{bytes, path}}) in any file {listed}"
            )
        return f"{what}; name the column to encode with --column"

    def path(self, rel: str) -> str:
        """``file:row`` of item ``rel``; ``<where>#<rel>`` for a row no scan found (a root names
        it, its file is gone: its feature is served from the store)."""
        at = self.items.get(rel)
        return f"{self.where}#{rel}" if at is None else f"{self.files[at.file].path}:{at.row}"

    def size(self, rel: str) -> int:
        return 0  # not known before the cell is read

    def row(self, rel: str) -> dict[str, Any]:
        """The row's other columns as Python values (its ``id`` and encoded column left out).

        They are read through the reader the scan opened, so a local file's stand only while
        the file is still that version (checked after the read: a dataset asks for a row long
        after its scan, and an Arrow file rewritten in place shows its new bytes at the old
        offsets).

        Raises:
            SourceError: the row is unknown, or its file was replaced since its rows were read.
        """
        at = self.items.get(rel)
        if at is None:
            raise SourceError(f"{self.where}: no row {rel!r} (its file is gone or changed)")
        f = self.files[at.file]
        names = [n for n in f.schema().names if n not in (self.column, "id")]
        values = f.cells(at.row, names) if names else {}
        if not f.remote and (f.stat() is None or self.replaced([f.path])):
            raise SourceError(f"{self.path(rel)}: {replaced_since_scan(f.path)}")
        return values

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each cell, reading only files whose stat the hash cache does not know
        (see :func:`hash_items`); a row's entry is keyed by its name and the column. ``held``
        keeps the cells' bytes, for the build to decode. The files to read are read by
        ``digester``'s container reader (default: here, file after file; an engine's: on its
        cluster, each file's :class:`CellReading`). A local table's path-only cells are the
        files they name, hashed as a folder's files are (:func:`hash_linked`)."""
        files = {p: split_item_path(p) for p in paths}
        replaced = self.replaced({file for file, _ in files.values()})
        linked, refused = self.linked_cells([p for p, (f, _) in files.items() if f not in replaced])
        refs = [
            ItemRef(p, f"{p}:{self.column}", file, int(row))
            for p, (file, row) in files.items()
            if file not in replaced and p not in linked and p not in refused
        ]
        total = len(refs) + len(set(linked.values()))
        digests, failed = hash_listed(
            self, catalog, refs, self.reading, counted(progress, 0, total), stats, held,
            containers_of(digester),
        )  # fmt: skip
        if linked:
            got, bad = hash_linked(
                catalog, linked, counted(progress, len(refs), total), stats, held, digester
            )
            digests.update(got)
            failed.update(bad)
        failed.update(refused)
        failed.update({p: replaced[file] for p, (file, _) in files.items() if file in replaced})
        return digests, failed

    def linked_cells(self, paths: Sequence[str]) -> tuple[dict[str, str], dict[str, str]]:
        """(cell -> the file it names, cell -> why not) for each of the cells ``paths`` that
        holds a path and no bytes (see the section's comment), read through the reader the
        scan opened (the version whose rows the ids are); the others are left to the cell
        reading. A local table's only: a bucket's path-only cells fail by the cell rule."""
        linked: dict[str, str] = {}
        refused: dict[str, str] = {}
        if self.remote or self.text or self.column is None:
            return linked, refused
        by_file: dict[str, dict[int, str]] = {}
        for p in paths:
            file, row = split_item_path(p)
            by_file.setdefault(file, {})[int(row)] = p
        for file, wanted in by_file.items():
            named = self._path_only(file, wanted)
            if not named:
                continue
            gone = self.replaced([file]).get(file)  # replaced meanwhile
            for at, where in named.items():
                cell = wanted[at]
                try:
                    linked[cell], place = self.named_file(where, file)
                    self.taken.note(place)
                except SourceError as e:
                    refused[cell] = f"{cell}: {e}"
                    self.taken.note_missing(where)
                if gone is not None:
                    linked.pop(cell, None)
                    refused[cell] = gone
        return linked, refused

    def named_file(self, named: str, table_file: str) -> tuple[str, CellPlace]:
        """The local file a path-only cell's ``named`` path names in ``table_file``, and where
        it was found (:meth:`CellPaths.file`); an absolute path naming a file is taken as it
        is, without reading the working directory (which may be gone).

        Raises:
            SourceError: it names no file at any place looked at, or is a URL.
        """
        if os.path.isabs(named) and os.path.isfile(named):
            return os.path.normpath(named), CellPlace.ABSOLUTE
        return self.cell_paths.file(named, table_file)

    def linked_missing(self, rel: str) -> bool:
        """Whether item ``rel``'s cell holds a path and no bytes, and no file is at that path
        now (deleted since its build, or a relative path a dataset run from another directory
        does not reach): gone, as a manifest row's missing file is, so a dataset serves the
        features its build stored (:func:`~featbake.encode.inputs.input_gone`)."""
        named = self.cell_path(rel)
        if named is None or urlparse(named).scheme:
            return False
        try:
            self.named_file(named, self.files[self.items[rel].file].path)
        except SourceError:
            return True
        return False

    def cell_path(self, rel: str) -> str | None:
        """The path item ``rel``'s cell names where it holds a path and no bytes (as the
        table's file holds it now), else None (bytes, or no such item)."""
        at = self.items.get(rel)
        return None if at is None else self._paths_named(at.file).get(at.row)

    def cell_files(self, rel: str) -> list[str]:
        """Each file item ``rel``'s path-only cell names at a place it is looked for at (see
        :class:`CellPaths`), in order, whether a file is there or not: what its build may
        have hashed it as (the hash cache's rows are by these names); none for a cell that
        holds bytes or a URL."""
        named = self.cell_path(rel)
        if named is None or urlparse(named).scheme:
            return []
        table_file = self.files[self.items[rel].file].path
        return [file for file, _ in self.cell_paths.places(named, table_file)]

    def _paths_named(self, index: int) -> dict[int, str]:
        """:meth:`_path_only` of every scanned row of the table's file ``index``, read once
        per scan: a dataset asks of each row it cannot hash (every row, opened from a
        directory its relative paths do not reach), and each ask read the column again."""
        found = self._named.get(index)
        if found is None:
            rows = [at.row for at in self.items.values() if at.file == index]
            found = self._named[index] = self._path_only(self.files[index].path, rows)
        return found

    def _path_only(self, file: str, rows: Collection[int]) -> dict[int, str]:
        """row -> path, for each of ``rows`` of the table's ``file`` whose cell holds a path
        and no bytes; none where its cells are no Audio/Image structs or its column cannot be
        read (the cell reading then fails each cell, saying why)."""
        index = self.file_positions().get(file)
        if index is None or index >= len(self.kinds) or self.kinds[index] is not CellKind.STRUCT:
            return {}
        try:
            return self.files[index].path_only(str(self.column), rows)
        except ARROW_READ_ERRORS:
            return {}

    def replaced(self, files: Collection[str]) -> dict[str, str]:
        """file -> why, for each local file of ``files`` the scan read that is not that
        version any more (renamed over, or rewritten, since): the ids' rows are the other
        version's, so no digest the hash cache holds for the file now may stand for them (a
        folder swapped back to a version hashed before keeps its files' stats)."""
        return replaced_files(self.scanned, files, replaced_since_scan)

    def reading(self, file: str, refs: list[ItemRef]) -> CellReading:
        """How ``refs``' cells of ``file`` are read for their digests, by any process: the
        file (opened afresh in another process), the column and its kind of cell there.

        Raises:
            SourceError: ``file`` is not one of the table's scanned files.
        """
        index = self.file_index(file)
        wanted = {r.where: r.path for r in refs}
        return CellReading(self.files[index], self.settled(file, index), wanted)

    def carried(self, path: str) -> CarriedCell | None:
        """What the scan settled for cell ``path`` (``file:row``): what a worker reads it by."""
        file = split_item_path(path)[0]
        index = self.file_positions().get(file)
        if index is None or index >= len(self.kinds) or self.column is None:
            return None
        return self.settled(file, index)

    def settled(self, file: str, index: int) -> CarriedCell:
        """What the scan settled for the cells of ``file`` (the table's ``index``-th file):
        the column, their kind, and the stat the scan read its rows at."""
        return CarriedCell(str(self.column), self.kinds[index], file in self.scanned,
                           self.scanned.get(file))  # fmt: skip

    def carry(self, rows: Mapping[str, object]) -> dict[str, str]:
        """Take one task's cells' :class:`CarriedCell` in a worker that did not scan the table
        (what it settles is per file: a table's files, not its rows, are held); path -> why
        for a cell whose file this node does not list."""
        if not all(isinstance(v, CarriedCell) for v in rows.values()):
            raise TypeError("a table's cells carry their CarriedCell")
        positions = self.file_positions()
        if len(self.kinds) < len(self.files):
            self.kinds += [CellKind.OTHER] * (len(self.files) - len(self.kinds))
        refused: dict[str, str] = {}
        for path, value in cast(Mapping[str, CarriedCell], rows).items():
            file = split_item_path(path)[0]
            index = positions.get(file)
            if index is None:
                refused[path] = f"{file}: not a file of the table {self.where} on this node"
                continue
            self.column, self.kinds[index] = value.column, value.kind
            if value.scanned_here:
                self.scanned[file] = value.scanned
        return refused

    def file_positions(self) -> dict[str, int]:
        """Each data file's index among the table's files (as listed: kinds may not be known)."""
        if not self.positions:
            self.positions = {f.path: i for i, f in enumerate(self.files)}
        return self.positions

    def source(self, inner: Source) -> Source:
        """The cells decoded by ``inner``; an audio recipe that would not decode what
        ``datasets`` gives for the column is warned of where the scan came first (a dataset's
        live encoding; a build notes it at its scan: :meth:`declared_note`)."""
        recipe = getattr(inner, "recipe", None)
        self.recipe = recipe if isinstance(recipe, Recipe) else None
        note = self.declared_note()
        if note is not None:
            warnings.warn(note, stacklevel=2)
        return CellSource(inner, self)

    def declared_audio(self, schema: pa.Schema) -> DeclaredAudio | None:
        """What the scanned column's ``datasets`` feature declares: a local ``save_to_disk``
        folder's ``dataset_info.json`` (what ``load_from_disk`` reads), else the first file's
        ``huggingface`` metadata (the Hub's parquet files, and Arrow files)."""
        saved = None if self.remote else saved_features(self.folder)
        return DeclaredAudio.of(hf_features(schema) if saved is None else saved, str(self.column))

    def declared_note(self) -> str | None:
        """One line saying the audio recipe's rate or channels are not what the column's
        ``datasets`` feature decodes its rows to, and the option that matches the column; None
        where they are, or until the scan and the source are both known."""
        recipe, declared = self.recipe, self.declared
        if recipe is None or declared is None or recipe.source != "audio":
            return None
        return declared.mismatch(recipe, self.where)

    def file_index(self, file: str) -> int:
        """The index of the data file ``file`` among the table's (after its scan).

        Raises:
            SourceError: ``file`` is not one of the table's files.
        """
        found = self.file_positions().get(file)
        if found is None or found >= len(self.kinds):
            raise SourceError(f"{file}: not a scanned file of the table {self.where}")
        return found


class CellPlace(enum.Enum):
    """Where a path-only cell's path was taken from (see :class:`CellPaths`)."""

    ABSOLUTE = "absolute"  # an absolute path: itself
    WORKDIR = "workdir"  # the working directory relative paths are taken from first
    BESIDE = "beside"  # the table file's folder
    HERE = "here"  # the working directory now, after a build's folder and the table's


#: How a message names each place a relative path is looked for at.
SAID_HERE = "from the working directory, as datasets opens it"
SAID_BUILD = "from the build's working directory, which its root records"
SAID_BESIDE = "beside the table file"


@dataclass(frozen=True)
class CellPaths:
    """Where a local table's path-only cells' relative paths are taken from, in order (see
    the section's comment): ``workdir`` (the working directory, as ``datasets`` opens them,
    or the one the table's build took them from, as its root records it), then the table
    file's folder, then ``here`` (the working directory now, where ``workdir`` is a build's
    that a rebuild run elsewhere was given: a clip neither place holds any more is looked for
    where ``datasets`` would open it; ``""``: not looked at, as a dataset does). A relative
    path is thus read from the files its build read, wherever it is opened again."""

    workdir: str
    said: str = SAID_HERE
    here: str = ""

    def places(self, named: str, table_file: str) -> list[tuple[str, CellPlace]]:
        """(file, the place it is taken from) for each place ``named`` is looked for at, in
        order, each file once (an absolute path: itself)."""
        if os.path.isabs(named):
            return [(os.path.normpath(named), CellPlace.ABSOLUTE)]
        beside = os.path.dirname(os.path.abspath(table_file))
        out: dict[str, CellPlace] = {}
        for folder, place in (
            (self.workdir, CellPlace.WORKDIR),
            (beside, CellPlace.BESIDE),
            (self.here, CellPlace.HERE),
        ):
            if folder:
                out.setdefault(os.path.normpath(os.path.join(folder, named)), place)
        return list(out.items())

    def file(self, named: str, table_file: str) -> tuple[str, CellPlace]:
        """The local file a path-only cell's ``named`` path names (in the table file
        ``table_file``), and the place it was found at: the first of :meth:`places` that
        holds a file (the first place tried alone first: a table's every row asks).

        Raises:
            SourceError: it names no file at any of them (each place looked at said), or is
                a URL.
        """
        if ":" in named and urlparse(named).scheme:  # datasets' is_local_path: no local file
            raise SourceError(
                f"the cell holds no bytes, only the path {named!r}, a URL featbake does not "
                "read; embed the bytes (datasets' embed_table_storage)"
            )
        if os.path.isabs(named):
            first = (os.path.normpath(named), CellPlace.ABSOLUTE)
        else:
            first = (os.path.normpath(os.path.join(self.workdir, named)), CellPlace.WORKDIR)
        if os.path.isfile(first[0]):
            return first
        places = self.places(named, table_file)
        found = next((p for p in places[1:] if os.path.isfile(p[0])), None)
        if found is not None:
            return found
        looked = (
            f"no file at {places[0][0]}"
            if len(places) == 1
            else "no file at "
            + " nor at ".join(f"{file} ({self.place_said(place)})" for file, place in places)
        )
        raise SourceError(f"the cell holds no bytes and its path {named!r} names {looked}")

    def place_said(self, place: CellPlace) -> str:
        """How a message names ``place``."""
        if place is CellPlace.WORKDIR:
            return self.said
        return SAID_BESIDE if place is CellPlace.BESIDE else SAID_HERE


@dataclass
class TakenFrom:
    """Where a scan's path-only cells' relative paths were found (:meth:`Table.linked_cells`),
    for its root to record the folder they were taken from (:attr:`Table.found_in`)."""

    relative: bool = False  # a cell named a relative path (found or not)
    workdir: bool = False  # one was found from :attr:`CellPaths.workdir`
    here: bool = False  # one was found only from :attr:`CellPaths.here`

    def note(self, place: CellPlace) -> None:
        """Count one cell found at ``place``."""
        if place is not CellPlace.ABSOLUTE:
            self.relative = True
            self.workdir |= place is CellPlace.WORKDIR
            self.here |= place is CellPlace.HERE

    def note_missing(self, named: str) -> None:
        """Count one cell naming ``named``, found nowhere."""
        if not os.path.isabs(named) and not urlparse(named).scheme:
            self.relative = True


def hash_linked(
    catalog: HashCache,
    linked: Mapping[str, str],
    progress: Callable[[Progress], None] | None,
    stats: dict[str, FileStat] | None,
    held: HeldBytes | None,
    digester: Digester,
) -> tuple[dict[str, str], dict[str, str]]:
    """Each path-only cell's digest (``linked``: cell -> the file it names): its file's, hashed
    as a folder's file is (:func:`hash_inputs`: through the hash cache by the file's path and
    stat; read by ``digester``), ``stats`` filled with the file's stat (what decoding checks
    it against), and the bytes ``held`` moved to the cells' names (decoded without a second
    read); (cell -> digest, cell -> why not)."""
    files = list(dict.fromkeys(linked.values()))
    file_stats: dict[str, FileStat] = {}
    got, bad = hash_inputs(catalog, files, progress, file_stats, held, digester=digester)
    digests: dict[str, str] = {}
    failed: dict[str, str] = {}
    rows: dict[str, list[str]] = {f: [] for f in files}
    for cell, file in linked.items():
        if file in got:
            digests[cell] = got[file]
            rows[file].append(cell)
            if stats is not None:
                stats[cell] = file_stats[file]
        else:
            failed[cell] = f"{cell}: {file}: {bad.get(file, 'not read')}"
    if held is not None:
        for file, cells in rows.items():
            held.share(file, cells)
    return digests, failed


def counted(
    progress: Callable[[Progress], None] | None, before: int, total: int
) -> Callable[[Progress], None] | None:
    """``progress`` told of one part of a hashing: its counts after ``before`` done, of
    ``total`` in all (a table's cells by their table files, then the files path-only cells
    name)."""
    if progress is None:
        return None
    tell = progress
    return lambda p: tell(dataclasses.replace(p, done=before + p.done, total=total))


def replaced_since_scan(file: str) -> str:
    """Why a row of a local table file renamed over (or rewritten) after the scan fails."""
    return (
        f"{file} was replaced since its rows were read (renamed over, or rewritten): each "
        "id's row is the other version's; rerun the build"
    )


@dataclass(frozen=True)
class CarriedCell:
    """What a table's scan settled that reading one cell needs: the column, its file's kind of
    cell, and the stat the scan read the file's rows at (a local file's; ``scanned_here``
    False: a bucket's, checked by its reads instead)."""

    column: str
    kind: CellKind
    scanned_here: bool
    scanned: FileStat | None


@dataclass(frozen=True)
class CellReading:
    """One table file's wanted cells read for their digests (a
    :class:`~featbake.encode.fingerprints.ContainerRead`): picklable, the file (a copy opens
    its own reader: :class:`TableFile`), what the scan settled for its cells (column, kind,
    and the stat the scan read the file's rows at: :class:`CarriedCell`), and row -> each
    cell's full name, so a process that never scanned the table (an engine's task) reads them
    as the build would, one row group at a time."""

    file: TableFile
    cell: CarriedCell
    wanted: dict[int, str]

    def __call__(self, held: Holder | None = None) -> ReadBack:
        """The cells' digests by full name, and the file's stat as of the reading (a local
        file's if it is still the one this process's reader opened; an object's from the
        GETs' responses: see :meth:`TableFile.stat`); None for a local file that is not the
        version the scan read its ids from (renamed over since: its rows are another
        version's, so the digests cannot stand for the ids)."""
        cell = self.cell
        got = cell_digests(self.file, cell.column, cell.kind, self.wanted, held)
        if cell.scanned_here and got.stat != cell.scanned:
            return ReadBack(got.digests, None)
        return got


class CellSource:
    """The recipe's source over a table's cells: each read from its row group (kept while the
    next rows are decoded) and decoded from its bytes.

    It reads through its :class:`Table`, whose column and files its scan settles (a build
    makes the source before it scans); pickled with it into decode workers, where each file is
    opened again.
    """

    def __init__(self, inner: Source, table: Table) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.extensions = inner.extensions
        self.table = table

    def read(self, path: str) -> bytes:
        """The bytes of the cell named ``path`` (``file:row``).

        Raises:
            SourceError: the file or row cannot be read, or the cell holds no bytes.
        """
        return self._cell(path, self.file_of(path))

    def file_of(self, path: str) -> TableFile:
        """The data file of the cell named ``path``.

        Raises:
            SourceError: it is not one of the table's scanned files.
        """
        return self.table.files[self.table.file_index(split_item_path(path)[0])]

    def _cell(self, path: str, f: TableFile) -> bytes:
        cell, kind = self._value(path, f)
        named = self.linked(cell, kind)
        if named is not None:  # a path-only cell: its file's bytes
            return self._linked(path, named, f).data
        got = cell_bytes(cell, kind)
        if isinstance(got, str):
            raise SourceError(f"{path}: {got}")
        return got

    def _value(self, path: str, f: TableFile) -> tuple[Any, CellKind]:
        """Cell ``path``'s Python value, and its file's kind of cell."""
        row = split_item_path(path)[1]
        column = str(self.table.column)
        kind = self.table.kinds[self.table.file_index(f.path)]
        try:
            return f.cells(int(row), [column])[column], kind
        except ARROW_READ_ERRORS as e:
            raise SourceError(f"{path}: cannot read column {column!r} ({first_line(e)})") from e

    def linked(self, cell: Any, kind: CellKind) -> str | None:
        """The path a path-only cell of a local table names (read from its file), else None."""
        return None if self.table.remote else path_only_cell(cell, kind)

    def _linked(self, path: str, named: str, f: TableFile) -> Whole:
        """The bytes of the file path-only cell ``path`` names, and its stat as they were read.

        Raises:
            SourceError: it names no file, or the file cannot be read.
        """
        try:
            file = self.table.named_file(named, f.path)[0]
        except SourceError as e:
            raise SourceError(f"{path}: {e}") from None
        try:
            return bytes_at(file).read(file)
        except SourceError as e:
            raise SourceError(f"{path}: {e}") from None

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read cell ``path`` and decode its bytes.

        Raises:
            SourceError: it cannot be read or decoded.
        """
        name = os.fspath(path)
        return self.inner.load(name, io.BytesIO(self.read(name)) if data is None else data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode cell ``path`` if its bytes came from its file as it was when its digest was
        taken: a file stat'ed after the read, an object by the stat the ranged GETs that
        carried them gave (:meth:`TableFile.stat`; no HEAD); a path-only cell's from the file
        it names, at the stat that file was hashed at (:meth:`_load_linked`).

        Raises:
            SourceError: the file changed since it was hashed, or the cell cannot be decoded.
        """
        changed = SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        f = self.file_of(path)
        if f.path in self.table.scanned and self.table.scanned[f.path] != stat:
            # Not the table file's stat: a path-only cell's (its file's), or a table replaced.
            return self._load_linked(path, f, stat)
        try:
            data = self._cell(path, f)
        except SourceError:
            # A file rewritten since its scan may not parse at all (its footer moved): say so.
            if (now := f.stat()) is not None and now != stat:
                raise changed from None
            raise
        if stat is None or f.stat() != stat:
            raise changed
        return self.inner.load(path, io.BytesIO(data))

    def _load_linked(self, path: str, f: TableFile, stat: FileStat | None) -> torch.Tensor:
        """Decode path-only cell ``path`` from the file it names if that file is still the one
        its digest was taken of (``stat``), and the table file the version the scan read.

        Raises:
            SourceError: the cell is no path-only cell and its table file was replaced since
                the scan (or was never hashed), the table file was replaced, the file the cell
                names changed since it was hashed, or it cannot be decoded.
        """
        replaced = SourceError(f"{path}: {replaced_since_scan(f.path)}")
        try:
            cell, kind = self._value(path, f)
        except SourceError:
            raise replaced from None
        named = self.linked(cell, kind)
        if named is None or self.table.replaced([f.path]):
            raise replaced
        got = self._linked(path, named, f)
        if stat is None or got.stat != stat:
            raise SourceError(
                f"{path}: the file its path {named!r} names changed since it was hashed; "
                "rerun the build"
            )
        return self.inner.load(path, io.BytesIO(got.data))


def table_at(data: str, column: str | None = None, workdir: str = "") -> Table:
    """The table at ``data`` (see :class:`Table`), its path-only cells' relative paths taken
    from ``workdir`` (``""``: the working directory)."""
    return Table(data, column, workdir)
