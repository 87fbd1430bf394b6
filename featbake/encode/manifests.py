"""Datasets listed by a manifest: a row per item, each a file or a segment of one.

Three layouts name their items this way (``--data`` picks one, see
:data:`featbake.encode.inputs.OPENERS`):

* :class:`ManifestInputs`: ``train.jsonl`` / ``.csv`` / ``.tsv``. The input column (``path``, or
  ``--column NAME``) holds a path relative to the manifest's folder, or an absolute one;
  optional ``start`` and ``end`` (seconds) make the row a segment (no ``start``: from 0, no
  ``end``: to the recording's end), ``channel`` picks one channel,
  ``id`` names the item (default: the path as written, plus ``#start-end`` for a segment), and
  every other column is carried (:meth:`RowInputs.row`).
* :class:`KaldiInputs`: a Kaldi data folder. ``wav.scp`` maps recording ids to files (a relative
  path is taken from the data folder, not the working directory Kaldi's scripts ran in); with a
  ``segments`` file each utterance is a segment (``utt rec start end``; ``end`` -1, Kaldi's
  convention, runs to the recording's end) and its id is the
  utterance id, else each recording is an item under its id. ``text`` and ``utt2spk`` are carried.
* :class:`CutsInputs`: a lhotse cut manifest (``cuts.jsonl.gz``), read with gzip and json (no
  lhotse): a cut's ``recording.sources`` of type ``file`` (a relative path taken from the
  manifest's folder), ``start``, ``duration``, ``channel``; its supervisions' text and speaker
  are carried.

**Items are the rows, in the manifest's order**, each named by its id (unique: a repeated id is
refused with one line naming both rows). A row's full name (:meth:`RowInputs.path`, what messages
and the decoders use) is ``<manifest>:<line>``.

**Keys.** A whole-file row is keyed by its file's SHA-256 (the same bytes in a folder give the
same key); a segment by ``item_digest("segment", file_sha256, start, end, channel)``. Each file is
hashed once through the hash cache (keyed by the file's path), however many segments it holds,
and its header read once to check every segment's bounds. Decoding a segment seeks to it and
reads only its samples (:meth:`featbake.encode.sources.AudioSource.load_span`), then mixes,
resamples, crops and normalises it exactly as a whole file: a recording is read about once for
all its segments, never once per segment. A file a whole-file row names is read once in a
first build: hashed from bytes kept (within the build's budget) to decode its rows, its segment
rows too (their bounds checked from those bytes).

**Bad rows** are skipped, one line each naming the manifest's line (the build then exits 3):
malformed JSON, a missing input column, a bad ``start``/``end``, a segment with ``start >= end``
(at the scan); a missing or unreadable file, a segment past the end of its recording, a channel
the file lacks (when hashing).

**Files in a bucket.** A row may name ``s3://bucket/key``: the object is hashed through the hash
cache by (size, last change, ETag) as ``--data s3://prefix/`` hashes its objects (from a LIST
of its folder where its rows name many of its objects, else a HEAD, the HEADs concurrent: see
:func:`featbake.encode.objects.stat_objects`; read whole only when the cache does not know it),
and decoded from its bytes: in a first build the bytes of the GET that hashed it (one GET in
all, see :meth:`RowInputs.hash`), else kept per process within :data:`OBJECT_CACHE_BYTES` so
that its segments read it once. Its segments' bounds are checked when they are decoded (a
segment past the end fails then, naming its line, and is skipped all the same).
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from featbake.encode.fingerprints import HeldBytes, hash_inputs, resolve_path
from featbake.encode.objects import (
    BucketInputs,
    object_at,
    object_stat,
    read_object,
    stat_objects,
)
from featbake.encode.sources import (
    ScanResult,
    SkippedInput,
    Source,
    Span,
    file_stat_or_none,
    span_problem,
)
from featbake.errors import ConfigError, SourceError
from featbake.keys import item_digest
from featbake.lru import ByteLRU
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.progress import Progress
from featbake.store.bucket import ObjectBytes
from featbake.store.catalog import FileStat, HashCache
from featbake.store.url import BucketURL, is_url

#: The input column when ``--column`` is not given.
DEFAULT_COLUMN = "path"
#: Columns a manifest row reads itself (besides the input column); every other one is carried.
OWN_COLUMNS = ("start", "end", "id", "channel")
#: A guess at a segment's bytes per second (16 kHz, 16-bit), to balance a build's parts.
SEGMENT_BYTES_PER_SECOND = 32_000
#: Bytes of bucket objects a decoding process keeps, so the segments of one recording in a
#: bucket read it once, not once per segment (a larger object is read per segment).
OBJECT_CACHE_BYTES = 512 << 20


# == rows ==========================================================================================
@dataclass(frozen=True)
class Item:
    """One row: its file (absolute), its segment (None: the whole file), where the manifest
    names it (``train.jsonl:12``), and its carried columns."""

    file: str
    span: Span | None
    where: str
    row: dict[str, Any] = field(default_factory=dict)


class BadRow(Exception):
    """A row that cannot be an item (raised while parsing, turned into a skip by the scan)."""


@dataclass
class Parsed:
    """What a layout's parser found: (id, item) in order, and the rows skipped with why."""

    items: list[tuple[str, Item]] = field(default_factory=list)
    skipped: list[SkippedInput] = field(default_factory=list)


def segment_id(path: str, span: Span | None) -> str:
    """A row's id when it names none: its path as written, plus ``#start-end`` for a segment.

    Example:
        >>> segment_id("a.wav", Span(1.5, 3.0))
        'a.wav#1.5-3.0'
    """
    return path if span is None else f"{path}#{span.start!r}-{span.end!r}"


def seconds(value: Any, name: str) -> float:
    """``value`` (a number, or text from a CSV) as seconds.

    Raises:
        BadRow: not a finite number of seconds at least 0.
    """
    try:
        if isinstance(value, bool):
            raise ValueError
        out = float(value)
    except (TypeError, ValueError):
        raise BadRow(f"{name} {value!r} is not a number of seconds") from None
    if not 0 <= out < float("inf"):
        raise BadRow(f"{name} {value!r} is not a time in the recording (seconds from 0)")
    return out


def channel_of(value: Any) -> int | None:
    """A row's ``channel`` (None or empty: all channels, mixed as the recipe says).

    Raises:
        BadRow: not a whole number at least 0.
    """
    if value is None or value == "":
        return None
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise BadRow(f"channel {value!r} is not a channel number") from None
    if isinstance(value, bool) or out < 0 or (isinstance(value, float) and out != value):
        raise BadRow(f"channel {value!r} is not a channel number")
    return out


def span_of(start: Any, end: Any, channel: int | None) -> Span | None:
    """The segment a row names (None: the whole file). No start is 0; no end is the
    recording's end (an infinite end, checked against the file's header when it is hashed or
    decoded), so ``[0, end of file)`` of all channels is the whole file, keyed as the file.

    Example:
        >>> span_of("1.5", None, None)
        Span(start=1.5, end=inf, channel=None)
        >>> span_of(0, None, None) is None
        True

    Raises:
        BadRow: start or end not seconds, or ``start >= end``.
    """
    first = 0.0 if start in (None, "") else seconds(start, "start")
    last = float("inf") if end in (None, "") else seconds(end, "end")
    if first >= last:
        raise BadRow(f"start {first} is not before end {last}")
    if first == 0.0 and last == float("inf") and channel is None:
        return None
    return Span(first, last, channel)


def input_file(value: Any, base: str, column: str) -> str:
    """The absolute file a row's input column names (relative to the manifest's folder).

    Raises:
        BadRow: empty or not text, or a bucket URL (not read from a manifest yet).
    """
    if not isinstance(value, str) or not value:
        raise BadRow(f"column {column!r} holds {value!r}, not a path")
    if is_url(value):
        try:
            BucketURL.parse(value.rpartition("/")[0])
        except ConfigError as e:
            raise BadRow(str(e)) from None
        return value
    if "://" in value:
        raise BadRow(
            f"{value}: featbake reads local paths and s3://, gs://, az:// URLs, not this scheme"
        )
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def manifest_item(
    fields: Mapping[str, Any], column: str, base: str, where: str
) -> tuple[str, Item]:
    """(id, item) of one manifest row (JSON object or CSV record).

    Raises:
        BadRow: no input column, or a bad path, start, end or channel.
    """
    if column not in fields:
        given = ", ".join(str(k) for k in fields) or "none"
        raise BadRow(f"no {column!r} column (columns: {given}); name the input with --column")
    if None in fields:  # a CSV record with more fields than the header
        raise BadRow("more fields than the header names")
    if None in fields.values():  # ... or fewer
        raise BadRow("fewer fields than the header names")
    file = input_file(fields[column], base, column)
    span = span_of(fields.get("start"), fields.get("end"), channel_of(fields.get("channel")))
    ident = fields.get("id")
    ident = segment_id(fields[column], span) if ident in (None, "") else str(ident)
    carried = {k: v for k, v in fields.items() if k != column and k not in OWN_COLUMNS}
    return ident, Item(file, span, where, carried)


# == row_inputs ====================================================================================
class RowInputs:
    """The items a manifest lists, as a build's :class:`~featbake.encode.inputs.Inputs`.

    Subclasses parse their layout (:meth:`parse`); everything else is shared: scan order is
    the manifest's, each file is hashed once for all its rows, a segment decodes by seeking.
    """

    def __init__(self, data: str | os.PathLike[str], column: str | None = None) -> None:
        self.origin = resolve_path(data)
        self.column = column
        self.items: dict[str, Item] = {}  # id -> item, in the manifest's order (after scan)
        self.by_path: dict[str, Item] = {}  # Item.where -> item

    @property
    def where(self) -> str:
        return self.origin

    @property
    def stat_tells_change(self) -> bool:
        return False  # an item is a row, not a file: revalidate is refused

    def parse(self) -> Parsed:
        """(id, item) per good row in order, and the bad rows (subclasses read their layout).

        Raises:
            SourceError: the manifest cannot be read at all.
        """
        raise NotImplementedError

    def scan(self, extensions: Sequence[str]) -> ScanResult:
        """The manifest's good rows' ids, in its order, and its bad rows with their reasons.

        Raises:
            SourceError: the manifest cannot be read, holds no row, or repeats an id.
        """
        parsed = self.parse()
        # Filled in place: a source made before the scan (the build makes it first) sees them.
        self.items.clear()
        self.by_path.clear()
        for ident, item in parsed.items:
            first = self.items.get(ident)
            if first is not None:
                raise SourceError(
                    f"id {ident!r} is on two rows ({first.where} and {item.where}); ids must be "
                    "unique: give each row its own id"
                )
            self.items[ident] = item
            self.by_path[item.where] = item
        if not self.items and not parsed.skipped:
            raise SourceError(f"{self.origin} lists no items; check the file")
        return ScanResult(list(self.items), parsed.skipped)

    def path(self, rel: str) -> str:
        item = self.items.get(rel)
        return item.where if item is not None else f"{self.origin}#{rel}"

    def size(self, rel: str) -> int:
        item = self.items.get(rel)
        if item is None:
            return 0
        if item.span is not None and not item.span.to_end:
            return max(1, round((item.span.end - item.span.start) * SEGMENT_BYTES_PER_SECOND))
        try:
            return os.stat(item.file).st_size
        except OSError:
            return 0

    def row(self, rel: str) -> dict[str, Any]:
        item = self.items.get(rel)
        return dict(item.row) if item is not None else {}

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Each row's digest (its file's SHA-256, or its segment's :func:`item_digest`), every
        file hashed once through the hash cache and its header read once for the bounds.
        ``held``, if given, keeps each ``s3://`` object's bytes read for its digest, and each
        local file's that only whole-file rows name, under its rows' paths (one copy, counted
        once, within the budget), for the build to decode them without a second GET or read;
        a local file's segments are read by seeking, as before.

        Returns:
            (path -> digest, path -> why the row cannot be an item); ``stats`` is filled with
            each row's file's stat (what decoding checks the file against).
        """
        stats = {} if stats is None else stats
        items = [self.by_path[p] for p in paths]
        files = list(dict.fromkeys(it.file for it in items))
        file_stats: dict[str, FileStat] = {}
        local = [f for f in files if not is_url(f)]
        whole = whole_files(items) if held is not None else set()
        digests, failed = hash_inputs(catalog, local, progress, file_stats, held, whole)
        urls = [f for f in files if is_url(f)]
        got, lost = object_digests(catalog, urls, file_stats, held)
        digests.update(got)
        failed.update(lost)
        spans = {it.file for it in items if it.span and it.file in digests and not is_url(it.file)}
        headers = audio_headers(spans, held)
        out: dict[str, str] = {}
        bad: dict[str, str] = {}
        for path, it in zip(paths, items, strict=True):
            why = failed.get(it.file) or headers.get(it.file) if it.span else failed.get(it.file)
            if isinstance(why, AudioHeader):
                why = why.problem(it.span)
            if why is not None:
                bad[path] = f"{it.where}: {it.file}: {why}"
                continue
            stats[path] = file_stats[it.file]
            sha = digests[it.file]
            out[path] = sha if it.span is None else segment_digest(sha, it.span)
        if held is not None:
            good = {p: it.file for p, it in zip(paths, items, strict=True) if p in out}
            held_by_row(held, [*urls, *(f for f in local if f in whole)], good)
        return out, bad

    def source(self, inner: Source) -> Source:
        return SegmentSource(inner, self.by_path)


def whole_files(items: Sequence[Item]) -> set[str]:
    """The local files a row names whole: a first build hashes them from bytes it keeps to
    decode (read once, issue 31 item 3), the file's segment rows too (a span decoded from the
    bytes in memory), since its whole-file row decodes all of it anyway. A file named by
    segment rows only is hashed streamed and its segments decoded by seeking: holding a long
    recording whole is what segments exist to avoid."""
    return {it.file for it in items if it.span is None and not is_url(it.file)}


def held_by_row(held: HeldBytes, urls: Sequence[str], file_of: Mapping[str, str]) -> None:
    """Move each object's (or whole local file's) bytes in ``held`` from its URL or path (kept
    so while hashing) to the paths of its rows (``file_of``: row path -> its file; a row failed
    before is left out): the build decodes by row, each row of one object from the same bytes."""
    rows: dict[str, list[str]] = {url: [] for url in urls}
    for path, file in file_of.items():
        if file in rows:
            rows[file].append(path)
    for url, paths in rows.items():
        held.share(url, paths)


def object_digests(
    catalog: HashCache,
    urls: Sequence[str],
    stats: dict[str, FileStat],
    held: HeldBytes | None = None,
) -> tuple[dict[str, str], dict[str, str]]:
    """(url -> SHA-256, url -> why not) of objects named one by one: each one's (size, last
    change, ETag), which the hash cache compares, from a listing of its folder or a HEAD,
    whichever takes fewer requests (:func:`featbake.encode.objects.stat_objects`: a rebuild
    of a manifest naming a folder's objects costs a LIST per 1,000, not a HEAD each), and
    read only when the cache does not know it (:meth:`featbake.encode.objects.BucketInputs.hash`,
    one place and one client per bucket; the bytes read kept in ``held`` by URL). An object
    missing or unreadable fails by its URL, as its HEAD says."""
    digests: dict[str, str] = {}
    failed: dict[str, str] = {}
    buckets: dict[str, list[str]] = {}  # scheme://bucket -> its rows' URLs
    for url in urls:
        where = BucketURL.parse(url.rpartition("/")[0])
        buckets.setdefault(f"{where.scheme}://{where.bucket}", []).append(url)
    for name, group in buckets.items():
        place = BucketInputs.at(name)
        infos = stat_objects(place.bucket, [place.rel(u) for u in group])
        for url in group:
            info = infos[place.rel(url)]
            if isinstance(info, str):
                failed[url] = info
            else:
                place.listed[place.rel(url)] = info
        got, lost = place.hash(catalog, [u for u in group if u not in failed], None, stats, held)
        digests.update(got)
        failed.update(lost)
    return digests, failed


def segment_digest(file_sha256: str, span: Span) -> str:
    """The digest of a segment of a file: its file's digest and its bounds (and channel).

    A channel picked from a whole file (no start/end) is the span ``[0, inf)``.
    """
    return item_digest("segment", file_sha256, span.start, span.end, span.channel)


@dataclass(frozen=True)
class AudioHeader:
    """A recording's header: what a segment's bounds are checked against."""

    frames: int
    rate: int
    channels: int

    def problem(self, span: Span | None) -> str | None:
        if span is None:
            return None
        return span_problem(span, self.frames, self.rate, self.channels)


def audio_headers(files: set[str], held: HeldBytes | None = None) -> dict[str, AudioHeader | str]:
    """file -> its header (one read of the header each; from the bytes ``held`` keeps for
    it, if any: no read), or why it cannot be read as audio."""
    import soundfile

    out: dict[str, AudioHeader | str] = {}
    for file in files:
        kept = held.peek(file) if held is not None else None
        opened = file if kept is None else io.BytesIO(kept)
        try:
            info = soundfile.info(opened)
        except (soundfile.LibsndfileError, RuntimeError, OSError) as e:
            why = str(e).strip().replace(repr(opened), repr(file)) or type(e).__name__
            out[file] = f"cannot read its audio header ({why})"
            continue
        out[file] = AudioHeader(int(info.frames), int(info.samplerate), int(info.channels))
    return out


class SegmentSource(ProcessLocalState):
    """The recipe's source over a manifest's rows: a whole file as the recipe reads it, a
    segment decoded by seeking (:meth:`featbake.encode.sources.AudioSource.load_span`).

    Args:
        inner: the recipe's source.
        rows: row path (``train.jsonl:12``) -> its item (the inputs' own table, filled by
            their scan).
    """

    def __init__(self, inner: Source, rows: Mapping[str, Item]) -> None:
        self.inner = inner
        self.rows = rows
        self.kind = inner.kind
        self.extensions = inner.extensions

    #: Bucket objects read here: per process, so a decode or DataLoader worker (forked or
    #: pickled) never takes a lock a parent's thread held at fork, nor carries held bytes.
    objects: ProcessLocal[HeldObjects] = ProcessLocal(lambda self: HeldObjects(), lock=True)

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Decode row ``path``: its file, or the span of it the row names.

        Raises:
            SourceError: the file cannot be decoded, or the span is not in it.
        """
        item = self.rows.get(os.fspath(path))
        if item is None:  # served from a root after its manifest lost the row
            raise SourceError(f"{path}: not a row of the manifest now; build it again")
        file, span = item.file, item.span
        if data is None and is_url(file):
            data = io.BytesIO(self.objects.get(file, path).data)
        try:
            if span is None:
                return self.inner.load(file, data)
            load_span = getattr(self.inner, "load_span", None)
            if load_span is None:
                raise SourceError(
                    f"{file}: segments (start, end, channel) are audio only; drop them from "
                    f"the manifest for --source {self.kind}"
                )
            out: torch.Tensor = load_span(file, span, data)
            return out
        except SourceError as e:
            raise SourceError(f"{path}: {e}") from None

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Decode row ``path`` if its file still has the stat its digest was taken at.

        Raises:
            SourceError: the file changed since it was hashed, is gone, or cannot be decoded.
        """
        item = self.rows.get(path)
        if item is not None and is_url(item.file):  # checked by the response's ETag
            got = self.objects.get(item.file, path)
            if stat is None or object_stat(got.info) != stat:
                self.objects.forget(item.file)
                raise SourceError(f"{path}: {item.file} changed since it was hashed; rerun")
            return self.load(path, io.BytesIO(got.data))
        x = self.load(path)
        file = self.rows[path].file  # there: load found it
        if stat is None or file_stat_or_none(file) != stat:
            raise SourceError(f"{path}: {file} changed while featbake was reading it; rerun")
        return x


class HeldObjects:
    """Bucket objects read whole in this process, kept within :data:`OBJECT_CACHE_BYTES`
    (least recently used out first): a recording's segments read it once. Held in a
    :class:`~featbake.process.ProcessLocal` (see :class:`SegmentSource`)."""

    def __init__(self) -> None:
        self.held: ByteLRU[str, ObjectBytes] = ByteLRU(OBJECT_CACHE_BYTES, lambda o: len(o.data))
        self.lock = threading.Lock()

    def get(self, url: str, path: str | os.PathLike[str]) -> ObjectBytes:
        """Object ``url``'s bytes and response (``path``: the row, for messages).

        Raises:
            SourceError: it is gone or cannot be read.
        """
        with self.lock:
            got = self.held.get(url)
        if got is not None:
            return got
        read = read_object(*object_at(url))
        if isinstance(read, str):
            raise SourceError(f"{path}: {url}: {read}")
        with self.lock:
            self.held.put(url, read)
        return read

    def forget(self, url: str) -> None:
        with self.lock:
            self.held.pop(url, None)


# == manifest ======================================================================================
class ManifestInputs(RowInputs):
    """``train.jsonl``, ``.csv`` or ``.tsv``: one item per row (see the module's docstring)."""

    def parse(self) -> Parsed:
        column = self.column or DEFAULT_COLUMN
        base = os.path.dirname(self.origin)
        name = os.path.basename(self.origin)
        parsed = Parsed()
        for line, fields in self._records():
            where = f"{self.origin}:{line}"
            try:
                if isinstance(fields, BadRow):
                    raise fields
                parsed.items.append(manifest_item(fields, column, base, where))
            except BadRow as e:
                parsed.skipped.append(SkippedInput(f"{name}:{line}", str(e)))
        return parsed

    def _records(self) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
        """(line number, fields or why the line is not a row) of each row."""
        try:
            with open(self.origin, encoding="utf-8", newline="") as f:
                if self.origin.lower().endswith(".jsonl"):
                    yield from json_records(f)
                else:
                    yield from table_records(
                        f, "\t" if self.origin.lower().endswith(".tsv") else ","
                    )
        except FileNotFoundError:
            raise SourceError(f"manifest {self.origin} does not exist; check --data") from None
        except (OSError, UnicodeDecodeError) as e:
            raise SourceError(f"manifest {self.origin} cannot be read ({e})") from None


def json_records(lines: Iterator[str] | Any) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
    """(line number, object) per non-blank line of a JSON-lines file; a line that is not a JSON
    object is a :class:`BadRow`."""
    for line, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            yield line, BadRow(f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        yield line, obj if isinstance(obj, dict) else BadRow("the line is not a JSON object")


def table_records(f: Any, delimiter: str) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
    """(line number, record) per row of a CSV/TSV file with a header line."""
    reader = csv.DictReader(f, delimiter=delimiter)
    try:
        for record in reader:
            yield reader.line_num, record
    except csv.Error as e:
        yield reader.line_num, BadRow(f"malformed {'TSV' if delimiter == chr(9) else 'CSV'} ({e})")


# == kaldi =========================================================================================
class KaldiInputs(RowInputs):
    """A Kaldi data folder: ``wav.scp`` (+ ``segments``, ``text``, ``utt2spk``)."""

    def parse(self) -> Parsed:
        if self.column is not None:
            raise SourceError(
                f"--column {self.column} names a manifest column; a Kaldi data folder "
                f"({self.origin}) has none: drop --column"
            )
        parsed = Parsed()
        recordings = self._recordings(parsed)
        carried = {n: kaldi_table(os.path.join(self.origin, n)) for n in ("text", "utt2spk")}
        segments = os.path.join(self.origin, "segments")
        if not os.path.isfile(segments):
            for rec, (file, where) in recordings.items():
                parsed.items.append((rec, Item(file, None, where, kaldi_row(rec, carried))))
            return parsed
        for line, fields in kaldi_lines(segments):
            where = f"{segments}:{line}"
            try:
                parsed.items.append(segment_item(fields, recordings, where, carried))
            except BadRow as e:
                parsed.skipped.append(SkippedInput(f"segments:{line}", str(e)))
        return parsed

    def _recordings(self, parsed: Parsed) -> dict[str, tuple[str, str]]:
        """recording id -> (file, where wav.scp names it); a piped entry refuses the folder.

        Raises:
            SourceError: an entry is a command (``cmd |``), not a file.
        """
        scp = os.path.join(self.origin, "wav.scp")
        out: dict[str, tuple[str, str]] = {}
        for line, fields in kaldi_lines(scp):
            if len(fields) < 2:
                parsed.skipped.append(SkippedInput(f"wav.scp:{line}", "no file after the id"))
                continue
            rec, value = fields[0], " ".join(fields[1:])
            if value.endswith("|"):
                raise SourceError(
                    f"{scp}:{line}: recording {rec} is a command ({value!r}), and featbake "
                    "reads files only: run each command once to write a wav file (e.g. `sox "
                    "in.sph out.wav`) and point wav.scp at the files"
                )
            file = os.path.normpath(os.path.join(self.origin, value))
            out[rec] = (file, f"{scp}:{line}")
        return out


def kaldi_lines(path: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, whitespace-separated fields) per non-blank line of a Kaldi table.

    Raises:
        SourceError: the file cannot be read.
    """
    try:
        with open(path, encoding="utf-8") as f:
            for line, text in enumerate(f, start=1):
                if text.strip():
                    yield line, text.split()
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path} cannot be read ({e})") from None


def kaldi_table(path: str) -> dict[str, str]:
    """``id rest...`` lines as id -> rest (``text``, ``utt2spk``); {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    return {fields[0]: " ".join(fields[1:]) for _, fields in kaldi_lines(path)}


def kaldi_row(ident: str, carried: Mapping[str, Mapping[str, str]]) -> dict[str, Any]:
    """An utterance's carried columns: its ``text`` and speaker (``utt2spk``) where given."""
    row: dict[str, Any] = {}
    if ident in carried["text"]:
        row["text"] = carried["text"][ident]
    if ident in carried["utt2spk"]:
        row["speaker"] = carried["utt2spk"][ident]
    return row


def segment_item(
    fields: list[str],
    recordings: Mapping[str, tuple[str, str]],
    where: str,
    carried: Mapping[str, Mapping[str, str]],
) -> tuple[str, Item]:
    """(utterance id, item) of one ``segments`` line: ``utt rec start end``.

    Raises:
        BadRow: not four fields, an unknown recording, or bad times.
    """
    if len(fields) != 4:
        raise BadRow(f"{len(fields)} fields, not 4 (utterance recording start end)")
    utt, rec, start, end = fields
    if rec not in recordings:
        raise BadRow(f"recording {rec!r} is not in wav.scp")
    row = {"recording": rec, **kaldi_row(utt, carried)}
    # Kaldi's end -1: to the end of the recording (the span's end is then the file's).
    span = span_of(start, None if end == "-1" else end, None)
    return utt, Item(recordings[rec][0], span, where, row)


# == cuts ==========================================================================================
class CutsInputs(RowInputs):
    """A lhotse cut manifest (``cuts.jsonl.gz``), read without lhotse."""

    def parse(self) -> Parsed:
        if self.column is not None:
            raise SourceError(
                f"--column {self.column} names a manifest column; a lhotse cut manifest "
                f"({self.origin}) names its audio in recording.sources: drop --column"
            )
        base = os.path.dirname(self.origin)
        name = os.path.basename(self.origin)
        parsed = Parsed()
        try:
            with gzip.open(self.origin, "rt", encoding="utf-8") as f:
                for line, cut in json_records(f):
                    try:
                        if isinstance(cut, BadRow):
                            raise cut
                        parsed.items.append(cut_item(cut, base, f"{self.origin}:{line}"))
                    except BadRow as e:
                        parsed.skipped.append(SkippedInput(f"{name}:{line}", str(e)))
        except FileNotFoundError:
            raise SourceError(f"cut manifest {self.origin} does not exist; check --data") from None
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise SourceError(f"cut manifest {self.origin} cannot be read ({e})") from None
        return parsed


def cut_item(cut: Mapping[str, Any], base: str, where: str) -> tuple[str, Item]:
    """(cut id, item) of one lhotse cut: its recording's file source, start and duration.

    Raises:
        BadRow: no id or recording, no file source, or bad times.
    """
    rec = cut.get("recording")
    if not isinstance(rec, Mapping) or "id" not in cut:
        raise BadRow("not a cut (no id or recording); featbake reads MonoCut lines")
    channel = cut.get("channel")
    sources = [s for s in rec.get("sources") or [] if isinstance(s, Mapping)]
    files = [s for s in sources if s.get("type") == "file"]
    if not files:
        kinds = ", ".join(sorted({str(s.get("type")) for s in sources})) or "none"
        raise BadRow(f"the recording has no source of type file (types: {kinds})")
    file = input_file(files[0].get("source"), base, "recording.sources[].source")
    channels = files[0].get("channels") or [0]
    if isinstance(channel, list):
        channel = None if sorted(channel) == sorted(channels) else channel
        if isinstance(channel, list):
            raise BadRow(f"channels {channel} of {channels}: a cut of several channels")
    picked = None if len(channels) <= 1 else channel_of(channel)
    start = seconds(cut.get("start", 0.0), "start")
    duration = cut.get("duration")  # none: to the recording's end
    end = None if duration is None else start + seconds(duration, "duration")
    span = span_of(start, end, picked)
    return str(cut["id"]), Item(file, span, where, cut_row(cut))


def cut_row(cut: Mapping[str, Any]) -> dict[str, Any]:
    """A cut's carried columns: its supervisions' text and speaker, its recording's id."""
    sups = [s for s in cut.get("supervisions") or [] if isinstance(s, Mapping)]
    row: dict[str, Any] = {"recording": cut["recording"].get("id")}
    texts = [str(s["text"]) for s in sups if s.get("text")]
    if texts:
        row["text"] = " ".join(texts)
    speakers = [s["speaker"] for s in sups if s.get("speaker")]
    if speakers:
        row["speaker"] = speakers[0]
    return row
