"""Where a build's inputs live: a local folder, or a prefix in a bucket (``s3://bucket/audio/``).

The build (and its parts) ask one :class:`Inputs` for everything that differs between the two:
the name a root is keyed by, the sorted listing, each input's path and size, the digests through
the hash cache, and the source that decodes them. Keys do not depend on the place: the same
bytes in a folder and in a bucket give the same key, so their features are stored once.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import warnings
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, Protocol, runtime_checkable

from featbake.encode.fingerprints import Digester, HeldBytes, digest_here, hash_inputs
from featbake.encode.sources import ScanResult, SkippedInput, Source, source_extensions
from featbake.encode.tables import Table, is_table, table_at
from featbake.encode.webdataset import is_webdataset, webdataset_at
from featbake.errors import ConfigError, FeatbakeError, SourceError
from featbake.progress import Progress
from featbake.store.byteplace import bytes_at
from featbake.store.files import gzip_compressed
from featbake.store.hash_cache import FileStat, HashCache, HashEntry, HashRow

if TYPE_CHECKING:  # torch where tensors are made: reading a root's data imports none
    import torch


# == inputs ========================================================================================
class Inputs(Protocol):
    """A data location as a build sees it (see :func:`inputs_at`)."""

    @property
    def where(self) -> str:
        """The location as roots and reports name it: a resolved folder, or a bucket URL."""
        ...

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The inputs with one of ``extensions`` (relative names, sorted) and files skipped."""
        ...

    def path(self, rel: str) -> str:
        """The full name of input ``rel``: what messages, the hash cache and decoders use."""
        ...

    def size(self, rel: str) -> int:
        """Input ``rel``'s size in bytes (0 if unknown), to balance a build's parts."""
        ...

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """(path -> SHA-256, path -> why it could not be read), as :func:`hash_inputs` says.

        With ``held``, the bytes read for a digest are kept there (within its budget) under
        the input's path, for the build to decode them: a first build reads each input once
        (issue 31 item 3). A kind whose bytes are held otherwise may keep none. ``digester``
        reads and hashes what the hash cache does not know (default: here; an engine's
        cluster where :func:`digested_anywhere` says the kind allows it).
        """
        ...

    @property
    def stat_tells_change(self) -> bool:
        """Whether one ``stat`` of an input tells that it changed (``revalidate=True``)."""
        ...

    def source(self, inner: Source) -> Source:
        """``inner`` (the recipe's source), made to read inputs from this place."""
        ...

    def row(self, rel: str) -> dict[str, Any]:
        """Item ``rel``'s carried columns (labels, speaker, caption); ``{}`` for files."""
        ...


class Folder:
    """Inputs one file each under a folder: a local folder scanned recursively, or the objects
    under a bucket prefix (:class:`BucketInputs`), listed, stat'ed and hashed through the place
    they are at (:mod:`featbake.store.byteplace`), the one interface both go through.

    Inputs are named by the folder and their relative name, sorted by it (a listing's hidden
    names, ``.x/`` or ``.x``, passed over). A prefix's listing gives each object's size, last
    change and ETag: an unchanged object (same listing) reuses its digest and is never read,
    so a rebuild downloads nothing for what the store already holds.
    """

    hashed_anywhere: ClassVar[bool] = True  # see digested_anywhere

    def __init__(self, data: str | os.PathLike[str]) -> None:
        where = os.fspath(data)
        self.place = bytes_at(where)
        self.folder = self.place.folder(where)
        #: input path -> its stat as the scan's listing gave it (a prefix's objects; no
        #: request to stat them again), and their sizes
        self.listed: dict[str, FileStat] = {}
        self.sizes: dict[str, int] = {}

    @property
    def where(self) -> str:
        return self.folder

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The inputs with one of ``extensions``, sorted by name (see :func:`scan_inputs`).

        Raises:
            SourceError: none (an empty or missing folder or prefix, or files of other kinds).
            StoreError: the bucket cannot be listed (no credentials, no such bucket, denied).
        """
        found = self.place.inputs(self.folder, extensions)
        self.listed = {self.path(r): st for r, st in found.listed.items()}
        self.sizes = {r: st.size for r, st in found.listed.items()}
        return ScanResult(found.inputs, [SkippedInput(*s) for s in found.skipped], found.notes)

    def path(self, rel: str) -> str:
        return f"{self.folder.rstrip('/')}/{rel}"  # a folder's path, or an object's URL

    def rel(self, path: str) -> str:
        return path[len(self.folder.rstrip("/")) + 1 :]

    def size(self, rel: str) -> int:
        if rel in self.sizes:
            return self.sizes[rel]
        st = self.place.stat(self.path(rel))
        return 0 if st is None else st.size  # it fails, with its reason, when it is hashed

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """SHA-256 of each input through the hash cache (:func:`hash_inputs`), the stats the
        scan's listing gave taken as they are; those it does not know read by ``digester``
        (default: here; an engine's cluster, see :func:`digested_anywhere`)."""
        return hash_inputs(
            catalog, paths, progress, stats, held, known=self.listed, digester=digester
        )

    @property
    def stat_tells_change(self) -> bool:
        return True

    def source(self, inner: Source) -> Source:
        return inner

    def row(self, rel: str) -> dict[str, Any]:
        return {}


class BucketInputs(Folder):
    """The objects under ``s3://bucket/prefix/`` (``gs://``, ``az://``) as a build's inputs.

    Each is decoded from its bytes read whole into memory (one clip or image; soundfile and
    Pillow read file objects): nothing is written to disk. A first build decodes from the
    bytes of the very response that was hashed, kept in the build's
    :class:`~featbake.encode.fingerprints.HeldBytes` (one GET per new object, issue 31 item
    3); an object past that budget is read again, and fails if that response's ETag is not
    the one hashed (:meth:`ObjectSource.load_unchanged`).
    """

    @classmethod
    def at(cls, where: str) -> BucketInputs:
        """The inputs under the URL ``where`` (``s3://bucket/prefix/``); nothing is read yet."""
        return cls(where)

    @property
    def stat_tells_change(self) -> bool:
        return False  # an object's ETag needs a request per item: revalidate is refused

    def source(self, inner: Source) -> Source:
        return ObjectSource(inner)


class ObjectSource:
    """The recipe's source over objects in a bucket: each read whole through the byte seam and
    decoded from its bytes (pickled into decode workers as it is: each process makes its own
    client, :func:`featbake.store.byteplace.object_at`)."""

    def __init__(self, inner: Source) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.extensions = inner.extensions

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Read object ``path`` (a URL) and decode its bytes.

        Raises:
            SourceError: it is gone, cannot be read, or cannot be decoded.
        """
        if data is None:
            data = io.BytesIO(bytes_at(os.fspath(path)).read(os.fspath(path)).data)
        return self.inner.load(path, data)

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode object ``path`` if the response carrying its bytes has the stat (ETag, size,
        last change) its digest was taken with.

        Raises:
            SourceError: it changed since it was hashed, is gone, or cannot be decoded.
        """
        got = bytes_at(path).read(path)
        if stat is None or got.stat != stat:
            raise SourceError(f"{path}: changed while featbake was reading it; rerun the build")
        return self.inner.load(path, io.BytesIO(got.data))


# == dispatch ======================================================================================
# Which kind of data ``--data`` names, tried in order: the first test that holds opens it.
#
# Each entry is (test, opener): the test looks at the name (and at most the folder's listing, a
# bucket prefix's by one LIST),
# the opener makes the :class:`Inputs` and reads nothing yet (a manifest is parsed by its
# ``scan``). Kinds with a module of their own are imported by their opener, so that module may
# import this one. A folder is the last resort: a name no test claims is read as a folder (and a
# missing one is refused by the scan, as before).
# Each opener takes (where, column, workdir): ``workdir`` is the folder a layout that takes
# relative paths from the working directory (Kaldi's ``wav.scp``, lhotse cuts, a table's
# path-only cells) takes them from (``""``: the working directory now); the other kinds' paths
# do not depend on it.
Opener = Callable[[str, str | None, str], Inputs]


#: The endings of a manifest of rows (JSON lines, NeMo's ``.json`` of JSON lines, CSV, TSV),
#: each also gzip-compressed (``rows.csv.gz``: read through gzip, see ``open_manifest``).
MANIFEST_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv")
MANIFEST_NAMES = (*MANIFEST_SUFFIXES, *(f"{s}.gz" for s in MANIFEST_SUFFIXES))


def _is_manifest(where: str) -> bool:
    # A .jsonl.gz here is one _is_cuts passed over: its first line is a row, not a cut.
    return bytes_at(where).is_list_file(where, MANIFEST_NAMES)


def _is_cuts(where: str) -> bool:
    place = bytes_at(where)
    if place.is_list_file(where, (".jsonl.gz",)):
        first = first_line_object(where)
        return first is None or is_a_cut(first)  # unreadable: the cut reader says why
    if not place.is_list_file(where, (".jsonl",)):
        return False
    first = first_line_object(where)
    return first is not None and is_a_cut(first)


#: How many bytes of a manifest's first line are read at a time to tell a lhotse cut from a
#: row: the line may be of any length (a cut's ``custom`` holding an alignment), and it is
#: read through, a piece at a time, never whole (:class:`FirstLine`).
READ_BYTES = 1 << 16
#: The longest key or text value of the first line kept to be looked at (a cut's ``type``);
#: a longer one is passed over unread (no cut's type is that long).
KEPT_BYTES = 1 << 10
#: The fields of the first line looked at (:func:`is_a_cut`).
CUT_FIELDS = frozenset({"type", "recording", "tracks"})

_NOT_SPACE = re.compile(rb"[^ \t\r]")  # a JSON line's blanks (a newline ends the line)
_TEXT_STOP = re.compile(rb'["\\\n]')  # what ends or escapes a JSON string, or the line
_NESTED_STOP = re.compile(rb'["{}\[\]\n]')  # what opens or closes a nested value
_SCALAR_END = re.compile(rb"[,}\]\s]")  # what follows a number, true, false or null
_ANY = re.compile(rb".", re.DOTALL)


class ReadsBytes(Protocol):
    """A file read by pieces: a plain file, a gzip stream."""

    def read(self, size: int, /) -> bytes: ...


class FirstLine:
    """A JSON object on a file's first line, read a piece at a time: the values of a few of its
    top-level fields, every other value passed over by its brackets and quotes (JSON's
    structural characters are ASCII, never inside a UTF-8 sequence), so memory holds
    :data:`READ_BYTES` and the kept values whatever the line's length.

    Args:
        f: the file's bytes (plain, or a gzip stream), from its start.
    """

    def __init__(self, f: ReadsBytes) -> None:
        self.f = f
        self.buf = b""
        self.pos = 0

    def more(self) -> bool:
        """Read the next piece, dropping what was passed; False at the file's end."""
        piece = self.f.read(READ_BYTES)
        self.buf, self.pos = self.buf[self.pos :] + piece, 0
        return bool(piece)

    def to(self, stop: re.Pattern[bytes], kept: bytearray | None = None) -> bytes:
        """Go past the next byte ``stop`` matches and return it (b"" at the file's end),
        adding the bytes gone past to ``kept`` while it is short."""
        while True:
            m = stop.search(self.buf, self.pos)
            end = m.end() if m else len(self.buf)
            if kept is not None and len(kept) <= KEPT_BYTES:
                kept += self.buf[self.pos : end]
            self.pos = end
            if m:
                return m.group()
            if not self.more():
                return b""

    def next_char(self) -> bytes:
        """The next byte that is not a blank, not gone past (b"\\n" at the line's end)."""
        while (m := _NOT_SPACE.search(self.buf, self.pos)) is None:
            self.pos = len(self.buf)
            if not self.more():
                return b""
        self.pos = m.start()
        return self.buf[self.pos : self.pos + 1]

    def take(self, char: bytes) -> bool:
        """Go past the next non-blank byte if it is ``char``."""
        if self.next_char() != char:
            return False
        self.pos += 1
        return True

    def text(self, keep: bool) -> str | None:
        """A JSON string whose opening quote is next, gone past: its value if ``keep`` and
        short, else "" (None: the line ends inside it)."""
        if not self.take(b'"'):
            return None
        kept = bytearray(b'"') if keep else None
        while (c := self.to(_TEXT_STOP, kept)) == b"\\":
            self.to(_ANY, kept)  # the escaped byte, whatever it is
        if c != b'"':
            return None
        if kept is None or len(kept) > KEPT_BYTES:
            return ""
        try:
            return str(json.loads(bytes(kept)))
        except ValueError:
            return None

    def passed(self) -> bool:
        """Go past the next value (any size); False if the line ends inside it."""
        c = self.next_char()
        if c == b'"':
            return self.text(keep=False) is not None
        if c not in (b"{", b"["):  # a number, true, false or null
            if not c or c not in b"-0123456789tfnNI":  # NaN, Infinity: json.dumps writes them
                return False
            return self.to(_SCALAR_END) not in (b"", b"\n") and self._back()
        depth = 0
        while (c := self.to(_NESTED_STOP)) not in (b"", b"\n"):
            if c == b'"':
                self.pos -= 1
                if self.text(keep=False) is None:
                    return False
            else:
                depth += 1 if c in b"{[" else -1
                if depth == 0:
                    return True
        return False

    def _back(self) -> bool:
        self.pos -= 1  # the byte that ended a scalar is the caller's (a comma, a bracket)
        return True

    def value(self) -> Any:
        """The next value as :func:`is_a_cut` looks at it: a short text as it is, ``{}`` for
        any object, None for anything else, gone past (:data:`_UNREAD`: the line ends in it)."""
        c = self.next_char()
        if c == b'"':
            got = self.text(keep=True)
            return _UNREAD if got is None else got
        if not self.passed():
            return _UNREAD
        return {} if c == b"{" else None

    def fields(self, names: Collection[str]) -> dict[str, Any] | None:
        """``names``' values (:meth:`value`) of the object that is the first line, or None
        where that line is no JSON object (it ends inside one, or holds something else)."""
        if self.more() and self.buf.startswith(b"\xef\xbb\xbf"):
            self.pos = 3  # a byte-order mark (utf-8-sig), as the manifest readers drop it
        if not self.take(b"{"):
            return None
        got: dict[str, Any] = {}
        if self.take(b"}"):
            return got if self.next_char() in (b"", b"\n") else None
        while (key := self.text(keep=True)) is not None and self.take(b":"):
            value = self.value() if key in names else (None if self.passed() else _UNREAD)
            if value is _UNREAD:
                return None
            if key in names:
                got[key] = value
            if self.take(b"}"):
                return got if self.next_char() in (b"", b"\n") else None
            if not self.take(b","):
                return None
        return None


#: A value the first line ends inside: that line is no JSON object.
_UNREAD = object()


def first_line_object(path: str) -> dict[str, Any] | None:
    """The fields :func:`is_a_cut` looks at (``type``, ``recording``, ``tracks``) of the JSON
    object on a local ``.jsonl`` (or gzip-compressed ``.jsonl.gz``) file's first line, or None
    where the file cannot be read or that line is no JSON object. The line is read through,
    however long, holding a piece of it at a time (:class:`FirstLine`)."""
    try:
        with open(path, "rb") as raw:
            f = gzip.GzipFile(fileobj=raw) if gzip_compressed(raw) else raw
            return FirstLine(f).fields(CUT_FIELDS)
    except (OSError, EOFError, zlib.error):  # a damaged gzip body: the reader says why
        return None


def is_a_cut(first: Mapping[str, Any]) -> bool:
    """Whether a manifest's first object is a lhotse cut (a ``type`` ending in ``Cut`` and a
    ``recording`` object, or a ``MixedCut``'s ``tracks``: a padded or mixed cut, which the
    cut manifest then refuses in one line): lhotse reads ``cuts.jsonl`` and ``cuts.jsonl.gz``
    alike, by their content, so a ``.jsonl`` may hold cuts and a ``.jsonl.gz`` rows.

    Example:
        >>> is_a_cut({"type": "MonoCut", "recording": {}}), is_a_cut({"path": "a.wav"})
        (True, False)
        >>> is_a_cut({"type": "MixedCut", "tracks": []})
        True
    """
    kind = str(first.get("type", ""))
    held = isinstance(first.get("recording"), dict) or "tracks" in first
    return held and kind.endswith("Cut")


def _is_bucket_prefix(where: str) -> bool:
    return bytes_at(where).remote


def _is_kaldi_dir(where: str) -> bool:
    return bytes_at(where).folder_has(where, "wav.scp")


def _open_manifest(where: str, column: str | None, workdir: str) -> Inputs:
    from featbake.encode.manifests import ManifestInputs

    return ManifestInputs(where, column)  # its paths are relative to its own folder


def _open_cuts(where: str, column: str | None, workdir: str) -> Inputs:
    from featbake.encode.manifests import CutsInputs

    return CutsInputs(where, column, workdir)


def _open_kaldi_dir(where: str, column: str | None, workdir: str) -> Inputs:
    from featbake.encode.manifests import KaldiInputs

    return KaldiInputs(where, column, workdir)


def _open_webdataset(where: str, column: str | None, workdir: str) -> Inputs:
    return webdataset_at(where, column)


def _open_table(where: str, column: str | None, workdir: str) -> Inputs:
    return table_at(where, column, workdir)


def _open_bucket(where: str, column: str | None, workdir: str) -> Inputs:
    _no_column(where, column)
    return BucketInputs(where)


def _open_folder(where: str, column: str | None, workdir: str = "") -> Inputs:
    _no_column(where, column)
    return Folder(where)


def _no_column(where: str, column: str | None) -> None:
    if column is not None:
        raise ConfigError(
            f"--column {column} names a column of a manifest or table, and {where} is a folder "
            "of files (each file is one item); drop --column, or point --data at the manifest"
        )


#: (test, opener) in order; the first test that holds picks the kind of ``--data``.
OPENERS: list[tuple[Callable[[str], bool], Opener]] = [
    (_is_cuts, _open_cuts),  # before .jsonl: cuts.jsonl.gz
    (_is_manifest, _open_manifest),
    (_is_kaldi_dir, _open_kaldi_dir),
    (is_webdataset, _open_webdataset),  # before a prefix: a prefix of tars only is shards
    (is_table, _open_table),
    (_is_bucket_prefix, _open_bucket),
]


def inputs_at(
    data: str | os.PathLike[str],
    column: str | None = None,
    source: str | None = None,
    workdir: str = "",
) -> Inputs:
    """The inputs at ``data``: the first kind in :data:`OPENERS` that claims it, else a folder.

    Args:
        data: a folder, a bucket prefix ``s3://bucket/audio/``, a manifest (``.jsonl``,
            ``.csv``, ``.tsv``, each also ``.gz``), a Kaldi data folder (holding ``wav.scp``), a
            lhotse cut manifest (``*.jsonl.gz``), and the kinds later entries add.
        column: the manifest's or table's column that names each item's input (default
            ``path``); refused for a folder or a bucket prefix.
        source: the recipe's source kind: for ``text`` a manifest's column holds each item's
            text itself, not a path (:class:`featbake.encode.texts.TextRows`).
        workdir: the folder a Kaldi folder's, a cut manifest's or a local table's path-only
            cells' relative paths are taken from (they take them from the working directory,
            as Kaldi, lhotse and ``datasets`` do): a root's
            record of its build's (:attr:`featbake.store.roots.Root.workdir`) where its data is
            opened again; ``""``: the working directory now.

    Raises:
        ConfigError: a URL of a scheme featbake does not speak, or ``column`` for a folder.

    Example:
        >>> inputs_at("s3://team/audio/").where
        's3://team/audio'
    """
    where = os.fspath(data)
    if source == "text" and _is_manifest(where):
        from featbake.encode.texts import TextRows

        return TextRows(where, column)
    for test, opener in OPENERS:
        if test(where):
            return opener(where, column, workdir)
    return _open_folder(where, column)


@runtime_checkable
class PathsFromWorkdir(Protocol):
    """Inputs that may take relative paths from a working directory: a Kaldi folder's
    ``wav.scp``, a cut manifest's sources (:class:`featbake.encode.manifests.RowInputs`), a
    local table's path-only cells (:class:`~featbake.encode.tables.Table`). Each records the
    folder it took them from in its root (:func:`workdir_of`) and is opened again from it
    (:func:`inputs_at`'s ``workdir``, :func:`falling_back_to`)."""

    #: The folder the root's build took relative paths from, given before a scan by
    #: :func:`falling_back_to`.
    build_workdir: str

    @property
    def paths_from_workdir(self) -> bool:
        """Whether this kind takes relative paths from the working directory at all."""
        ...

    @property
    def workdir_recorded(self) -> bool:
        """Whether it was opened with a build's folder (:func:`inputs_at`'s ``workdir``)."""
        ...

    @property
    def found_in(self) -> str:
        """The folder its last scan took relative paths from (``""``: none)."""
        ...


def workdir_of(inputs: Inputs) -> str:
    """The folder ``inputs``' relative paths were taken from, for its root to record
    (:attr:`featbake.store.roots.Root.workdir`): a Kaldi folder's, a cut manifest's or a
    table's whose path-only cells name relative paths (the working directory it was opened
    in, or the one it was opened with); ``""`` for every kind whose paths do not depend on
    the working directory."""
    return inputs.found_in if isinstance(inputs, PathsFromWorkdir) else ""


def falling_back_to(inputs: Inputs, build_workdir: str) -> None:
    """Give ``inputs`` (opened in this process's working directory) ``build_workdir``, the
    folder its root's build took relative paths from
    (:attr:`featbake.store.roots.Root.workdir`). A Kaldi folder or a cut manifest takes a
    relative path it does not find here from there: a rebuild run from another directory
    then reads every file its last build read (a dataset takes them from there alone:
    :func:`read_as_built`). A table takes its path-only cells' relative paths from there
    first (then its own folder, then here): its rows are the files its build read, not
    other files of the same names here (``datasets`` writes a table's paths as they were
    given, relative to where the table was made). Set before the scan; nothing for other
    kinds."""
    if takes_paths_from_workdir(inputs):
        assert isinstance(inputs, PathsFromWorkdir)
        inputs.build_workdir = build_workdir


def read_as_built(inputs: Inputs, build_workdir: str) -> None:
    """Give a dataset's ``inputs`` ``build_workdir``, the folder its root's build took
    relative paths from, as :func:`falling_back_to` does; a table's path-only cells' relative
    paths are then taken from there and beside the table only, a Kaldi folder's and a cut
    manifest's from there only (the folder their build read, whatever this process's
    working directory holds). A file found in none of them is gone (its row's stored
    features served as built, or kept back: featbake.serve.index), not read from another file
    of the same name in this process's working directory, which its build did not read; the
    root the dataset publishes keeps recording ``build_workdir``. Set before the scan.

    A ``build_workdir`` that is no folder now (the project moved, the job's scratch folder
    removed) holds none of the files built: the data is read as a build reads it
    (:func:`falling_back_to`: here, where the files may be now, each hashed and a changed one
    encoded live, and the root then records where they were found), after one warning; read
    as built, every row would have been served its stored features unchecked."""
    from featbake.encode.manifests import RowInputs

    falling_back_to(inputs, build_workdir)
    if not takes_paths_from_workdir(inputs) or not isinstance(inputs, (Table, RowInputs)):
        return
    if not os.path.isdir(build_workdir):
        warnings.warn(
            f"{inputs.where}'s relative paths were taken from {build_workdir} when it was "
            f"built, which is no folder now: reading them from {os.getcwd()} instead (a file "
            "changed since its build is encoded again); run `featbake build` from the folder "
            "they are relative to now to record it",
            stacklevel=4,
        )
        return
    inputs.reads_here = False


def paths_taken(inputs: Inputs) -> tuple[str, str]:
    """Where a build's ``inputs`` take relative paths from, for an engine's worker to take
    them from the same places, in the same order (:func:`taking_paths_as`): a local table's
    (this process's working directory, the folder :func:`falling_back_to` gave it);
    ``("", "")`` for other kinds (a Kaldi folder's or a cut manifest's rows carry the files
    they name to the worker)."""
    if isinstance(inputs, Table) and takes_paths_from_workdir(inputs):
        return inputs.paths_taken
    return "", ""


def taking_paths_as(inputs: Inputs, taken: tuple[str, str]) -> None:
    """Have a worker's ``inputs`` take relative paths as the build's process took them
    (``taken``: its :func:`paths_taken`); nothing where that is ``("", "")``."""
    if isinstance(inputs, Table) and taken[0]:
        inputs.take_paths_as(*taken)


def input_gone(inputs: Inputs, rel: str, listed: bool) -> bool:
    """Whether item ``rel``, which cannot be hashed now, is gone since its build: no longer
    listed (a folder's file, a tar's member, a table's row), or a folder's file, a manifest
    row's own file or the file a table's path-only cell names that no longer exists (or that
    a relative path no longer reaches from here). Else it is still there and cannot be read as it
    now is (a segment past the end of its rewritten file, a channel the file no longer has, a
    member cut short, a cell without bytes): not the input its stored features were made
    from. The one rule of what a dataset serves as built and what an export calls changed.
    An object in a bucket that a listing names is there (a stat per object is not paid)."""
    from featbake.encode.manifests import RowInputs

    if not listed:
        return True
    if isinstance(inputs, Table):  # a cell naming a file gone
        return inputs.linked_missing(rel)
    if isinstance(inputs, RowInputs):
        item = inputs.items.get(rel)
        file = None if item is None else item.file
    else:
        file = inputs.path(rel) if isinstance(inputs, Folder) else None
    return file is not None and not bytes_at(file).remote and not os.path.lexists(file)


def gone_files(inputs: Inputs, rels: Sequence[str]) -> dict[str, list[str]]:
    """Of items ``rels`` whose inputs are gone (:func:`input_gone`), the files each one's row
    names now as its input, by which the hash cache may know what its build read: a manifest's
    whole-file row's file; a table's path-only cell's file at each place it is looked for at
    (:meth:`~featbake.encode.tables.Table.cell_files`). An export checks them as a dataset does
    (a row changed since its build to name a file since deleted is not given another file's
    features). A segment is left out (its key needs its file's header, gone with it), as is
    every other kind (a folder's item names its file: it cannot come to name another)."""
    from featbake.encode.manifests import RowInputs

    out: dict[str, list[str]] = {}
    for rel in rels:
        if not input_gone(inputs, rel, listed=True):
            continue
        if isinstance(inputs, Table):
            files = inputs.cell_files(rel)
        elif isinstance(inputs, RowInputs) and (item := inputs.items.get(rel)) is not None:
            whole = item.span is None and item.effects is None
            files = [item.file] if whole else []
        else:
            files = []
        if files:
            out[rel] = files
    return out


def takes_paths_from_workdir(inputs: Inputs) -> bool:
    """Whether ``inputs`` takes relative paths from this process's working directory (a Kaldi
    folder, a cut manifest or a local table opened without a recorded folder)."""
    return (
        isinstance(inputs, PathsFromWorkdir)
        and inputs.paths_from_workdir
        and not inputs.workdir_recorded
    )


@runtime_checkable
class RowsCarried(Protocol):
    """Inputs whose names alone do not say how to decode them: what a scan found for each (a
    manifest row's file, span and effects; a text; a table cell's column and kind) is carried
    with the name to a process that did not scan (an engine's worker), so it neither parses
    the manifest again nor can find another version of it there."""

    def carried(self, path: str) -> object | None:
        """What decoding ``path`` needs beyond its name (picklable); None if not a scanned
        input."""
        ...

    def carry(self, rows: Mapping[str, object]) -> dict[str, str]:
        """Take one task's rows' :meth:`carried` values (path -> value) in a process that did
        not scan, in place of the rows carried before (a worker holds one task's at a time);
        path -> why, for each row it cannot take (a table's file not found on this node)."""
        ...


def carried_values(inputs: Inputs, paths: Sequence[str]) -> list[object | None]:
    """What a worker needs to decode each of ``paths`` beyond its name (:class:`RowsCarried`);
    all None for inputs their names say (files, objects, a tar's members)."""
    if not isinstance(inputs, RowsCarried):
        return [None] * len(paths)
    return [inputs.carried(p) for p in paths]


def carry_to(inputs: Inputs, rows: Mapping[str, object]) -> dict[str, str]:
    """Give ``inputs`` (a worker's, never scanned) one task's :func:`carried_values`; path ->
    why, for each row it cannot take."""
    return inputs.carry(rows) if isinstance(inputs, RowsCarried) else {}


def digested_anywhere(inputs: Inputs) -> bool:
    """Whether ``inputs``' new inputs may be read and hashed by any process that reaches them
    (their ``hash``'s ``digester``: an engine's cluster): a folder's files, a bucket prefix's
    objects and the files a manifest's rows name (jsonl/csv/tsv, Kaldi, lhotse cuts), each
    digest the SHA-256 of one file or object read whole (a segment's derived from its
    recording's; the recording's audio header, read for the bounds, is read here).

    A tar's members and a table's cells too: each container
    the hash cache does not know is read by one process, by what the driver's scan
    found (a :class:`~featbake.encode.fingerprints.ContainerRead`: a tar's member listing, a
    table's column and kind), through ``digester``'s container reader
    (:func:`~featbake.encode.fingerprints.containers_of`).

    A manifest's texts are hashed by the build's own process (no file to read).
    """
    return bool(getattr(inputs, "hashed_anywhere", False))


def keeps_order(inputs: Inputs) -> bool:
    """Whether ``inputs`` are served in the data's own order (a manifest's rows, a tar's
    samples) rather than sorted by name (a folder's files, a bucket's objects)."""
    return not isinstance(inputs, Folder)


# == redigested ====================================================================================
# ``featbake verify --repair`` drops hash-cache rows whose digest is wrong and re-keys the root
# items keyed from them. A folder's item names its file, but a manifest's, a tar's or a table's
# item is an id whose digest comes through its inputs (a segment's is derived from its
# recording's digest): only the inputs seam knows which rows an item's digest came from. So the
# repair (upkeep, which imports no encode code) is handed :func:`redigested` by the CLI.
class DigestView:
    """The hash cache as a reader sees it, with some rows' digests replaced, writing nothing:
    the digests items would get had those rows said ``overrides``."""

    def __init__(self, catalog: HashCache, overrides: Mapping[str, str]) -> None:
        self.catalog = catalog
        self.overrides = overrides

    def cached_hashes(self, paths: Sequence[str]) -> dict[str, HashEntry]:
        got = self.catalog.cached_hashes(paths)
        return {
            p: e._replace(sha256=self.overrides[p]) if p in self.overrides else e
            for p, e in got.items()
        }

    def put_hashes(self, rows: Iterable[HashRow], *, recorded_ns: int | None = None) -> None:
        return None  # a what-if: nothing is recorded


def redigested(
    data: str, source: str, catalog: HashCache, actual: Mapping[str, str], workdir: str = ""
) -> dict[str, tuple[str, str]]:
    """item id -> (its digest through the hash cache now, its digest had the rows ``actual``
    names held those digests), for the items of ``data`` whose digest the rows change.

    ``data`` is opened through :func:`inputs_at` with its default column (and its relative
    paths taken from ``workdir``, its root's record, as its build took them); data that cannot be
    opened or scanned any more, and a folder of files (re-keyed by their rows), give ``{}``
    (a build with another ``--column`` keys other digests: its items stay, the next build
    re-keys them). Items
    whose rows the hash cache lacks are read to be hashed (twice: what-ifs record nothing).

    Example:
        >>> redigested("/data/train.jsonl", "audio", catalog, {"/data/a.wav": "ab" * 32})
        ... # doctest: +SKIP
    """
    try:
        inputs = inputs_at(data, None, source, workdir)
        if isinstance(inputs, Folder):
            return {}  # a file's item names it: the repair re-keys it by its own row
        rels = inputs.scan(source_extensions(source)).inputs
        paths = {inputs.path(r): r for r in rels}
        now, _ = inputs.hash(DigestView(catalog, {}), list(paths))
        right, _ = inputs.hash(DigestView(catalog, actual), list(paths))
    except FeatbakeError:
        return {}
    return {paths[p]: (d, right[p]) for p, d in now.items() if right.get(p, d) != d}
