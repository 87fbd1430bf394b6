"""Datasets listed by a manifest: a row per item, each a file or a segment of one.

Three layouts name their items this way (``--data`` picks one, see
:data:`featbake.encode.inputs.OPENERS`):

* :class:`ManifestInputs`: ``train.jsonl`` / ``.csv`` / ``.tsv``, or a ``.json`` of JSON lines
  (NeMo's ``train_manifest.json``), each also gzip-compressed (``train.csv.gz``). The input column
  (``path``, or ``--column NAME``) holds a path relative to the manifest's folder, or an absolute
  one; optional ``start`` and ``end`` (seconds) make the row a segment (no ``start``: from 0, no
  ``end``: to the recording's end), as do ``start`` and ``duration`` (lhotse's timing) and
  ``offset`` and ``duration`` (NeMo's). A ``duration`` alone is a label of the whole file,
  except in a NeMo manifest's row (an ``audio_filepath``, :data:`NEMO_INPUT`), which NeMo's
  loader reads from 0 for that ``duration``; a NeMo ``duration`` of 0 or less reads to the end
  (:func:`nemo_end`), and a negative ``offset`` from 0 (:func:`nemo_offset`). ``channel``
  picks one channel, ``id`` names the item (default: the path as written, plus
  ``#start-end`` for a segment, :func:`named_span`), and every other column is carried
  (:meth:`RowInputs.row`). Seconds become samples by the rule of the tool whose fields time
  the row (:func:`row_rule`), so a row decodes as that tool's loader reads it:
  ``start``/``end`` to the nearest sample, ``start`` + ``duration`` as lhotse counts them,
  ``offset`` + ``duration`` as NeMo's ``AudioSegment.from_file`` truncates them (a read past
  the file's end stopping at it, as NeMo's does).
* :class:`KaldiInputs`: a Kaldi data folder. ``wav.scp`` maps recording ids to files (a relative
  path is taken from the working directory, as Kaldi's scripts take it; a dataset over a built
  root takes it from the folder the build took it from, :attr:`RowInputs.reads_here`); with a
  ``segments`` file each utterance is a segment (``utt rec start end [channel]``; ``end`` -1,
  Kaldi's convention, runs to the recording's end; a channel picks one) and its id is the
  utterance id, else each recording is an item under its id. ``text`` and ``utt2spk`` are carried.
* :class:`CutsInputs`: a lhotse cut manifest (``cuts.jsonl.gz``, or a ``.jsonl`` whose first
  line is a cut: lhotse's uncompressed ``cuts.jsonl``), read with gzip (if so) and json: a
  cut's ``start``, ``duration``, ``channel``, and of its recording the source (a ``file``, or a
  ``url`` in a bucket) that lists the channel (one file per channel, AMI and CHiME; a relative
  path is taken from the working directory, as lhotse takes it); a cut over channels of several
  sources is a bad row. A recording with ``transforms`` (speed, volume) is decoded by lhotse's
  own code (:class:`LhotseAudio`; a bad row where lhotse is not installed). Its supervisions'
  text and speaker are carried.

**Items are the rows, in the manifest's order**, each named by its id (unique: a repeated id is
refused with one line naming both rows). A row's full name (:meth:`RowInputs.path`, what messages
and the decoders use) is ``<manifest>:<line>``.

**Keys.** A whole-file row is keyed by its file's SHA-256 (the same bytes in a folder give the
same key); a segment by its sample bounds at the file's own rate (:func:`segment_digest`: a
lhotse cut, a Kaldi segment and a row naming the same samples share it). Each file is
hashed once through the hash cache (keyed by the file's path), however many segments it holds,
and its header read once to check every segment's bounds. Decoding a segment seeks to it and
reads only its samples (:meth:`featbake.encode.sources.AudioSource.load_span`), then mixes,
resamples, crops and normalises it exactly as a whole file: a recording is read about once for
all its segments, never once per segment. A file a whole-file row names is read once in a
first build: hashed from bytes kept (within the build's budget) to decode its rows, its segment
rows too (their bounds checked from those bytes).

**Reading rows.** A manifest is UTF-8, with or without the byte-order mark Excel's "CSV UTF-8"
writes. A TSV is not quoted (a quote mark is text: Common Voice's sentences open quotes); a CSV
is quoted as Excel writes it. A table's row names the line it starts on
(:func:`table_records`).

**Bad rows** are skipped, one line each naming the manifest's line (the build then exits 3):
malformed JSON or CSV, a table row with more or fewer fields than the header, a missing input
column, a bad ``start``/``end``, a segment with ``start >= end`` (at the scan); a missing or
unreadable file, a segment past the end of its recording, a channel the file lacks (when
hashing). An input column that **no** row holds (``--column`` mistyped) is not a bad row per
row but one :class:`~featbake.errors.SourceError` before any work, naming the columns there
are (:class:`ColumnsSeen`), as a table without the column is.

**Files in a bucket.** A row may name ``s3://bucket/key``: the object is hashed through the hash
cache by (size, last change, ETag) as ``--data s3://prefix/`` hashes its objects (from a LIST
of its folder where its rows name many of its objects, else a HEAD, the HEADs concurrent: see
:func:`featbake.store.byteplace.stat_objects`; read whole only when the cache does not know it),
and decoded from its bytes: in a first build the bytes of the GET that hashed it (one GET in
all, see :meth:`RowInputs.hash`), else kept per process within :data:`OBJECT_CACHE_BYTES` so
that its segments read it once. Its segments' bounds are checked when they are decoded (a
segment past the end fails then, naming its line, and is skipped all the same).
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import importlib.util
import io
import json
import os
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, ClassVar, NamedTuple, TextIO, TypeVar, cast

import numpy as np

from featbake.encode.fingerprints import (
    Digester,
    HeldBytes,
    digest_here,
    hash_inputs,
    resolve_path,
)
from featbake.encode.sources import (
    SampleRule,
    ScanResult,
    SkippedInput,
    Source,
    Span,
    file_stat_or_none,
    lhotse_bounds,
    span_problem,
)
from featbake.errors import ColumnMissing, ConfigError, SourceError
from featbake.keys import item_digest
from featbake.lru import ByteLRU
from featbake.process import ProcessLocal, ProcessLocalState
from featbake.progress import Progress
from featbake.store.byteplace import Whole, bytes_at
from featbake.store.files import gzip_compressed
from featbake.store.hash_cache import FileStat, HashCache

if TYPE_CHECKING:  # torch where tensors are made: reading a manifest's rows imports none
    import torch

#: The input column when ``--column`` is not given.
DEFAULT_COLUMN = "path"
T = TypeVar("T")
#: Columns a manifest row reads itself (besides the input column); every other one is carried.
OWN_COLUMNS = ("start", "end", "id", "channel")
#: The field NeMo's manifests name a row's audio by: a row holding it is timed as NeMo's
#: loader reads it (:func:`row_rule`), its ``duration`` the samples read, not a label.
NEMO_INPUT = "audio_filepath"
#: A guess at a segment's bytes per second (16 kHz, 16-bit), to balance a build's parts.
SEGMENT_BYTES_PER_SECOND = 32_000
#: Bytes of bucket objects a decoding process keeps, so the segments of one recording in a
#: bucket read it once, not once per segment (a larger object is read per segment).
OBJECT_CACHE_BYTES = 512 << 20


# == rows ==========================================================================================
@dataclass(frozen=True)
class Item:
    """One row: its file (absolute), its segment (None: the whole file), where the manifest
    names it (``train.jsonl:12``), its carried columns, and, for a lhotse cut with
    transforms, how lhotse decodes it (None: featbake reads the span itself)."""

    file: str
    span: Span | None
    where: str
    row: dict[str, Any] = field(default_factory=dict)
    effects: LhotseAudio | None = None


class BadRow(Exception):
    """A row that cannot be an item (raised while parsing, turned into a skip by the scan)."""


@dataclass
class Parsed:
    """What a layout's parser found: (id, item) in order, and the rows skipped with why."""

    items: list[tuple[str, Item]] = field(default_factory=list)
    skipped: list[SkippedInput] = field(default_factory=list)


def segment_id(path: str, span: Span | None) -> str:
    """A row's id when it names none: its path as written, plus ``#start-end`` for a segment
    and ``@chN`` where the row picks channel N (a call's two sides are rows of the same times
    on channels 0 and 1 of one file: each its own item).

    Example:
        >>> segment_id("a.wav", Span(1.5, 3.0)), segment_id("a.wav", Span(1.5, 3.0, 1))
        ('a.wav#1.5-3.0', 'a.wav#1.5-3.0@ch1')
    """
    if span is None:
        return path
    ident = f"{path}#{span.start!r}-{span.end!r}"
    return ident if span.channel is None else f"{ident}@ch{span.channel}"


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


def span_of(
    start: Any,
    end: Any,
    channel: int | None,
    rule: SampleRule = SampleRule.NEAREST,
    duration: float | None = None,
) -> Span | None:
    """The segment a row names (None: the whole file). No start is 0; no end is the
    recording's end (an infinite end, checked against the file's header when it is hashed or
    decoded), so ``[0, end of file)`` of all channels is the whole file, keyed as the file.
    ``rule``: how its seconds become samples (a lhotse cut's as lhotse counts them, from its
    ``duration`` as written).

    Example:
        >>> span_of("1.5", None, None)
        Span(start=1.5, end=inf, channel=None, rule=<SampleRule.NEAREST: 'nearest'>, duration=None)
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
    return Span(first, last, channel, rule, duration)


def input_file(value: Any, base: str, column: str) -> str:
    """The absolute file a row's input column names (relative to the manifest's folder).

    Raises:
        BadRow: empty or not text, or a bucket URL (not read from a manifest yet).
    """
    if not isinstance(value, str) or not value:
        raise BadRow(f"column {column!r} holds {value!r}, not a path")
    try:
        return bytes_at(value).named(value, base)
    except ConfigError as e:
        raise BadRow(str(e)) from None


def start_of(fields: Mapping[str, Any]) -> Any:
    """A row's ``start``, or, where it has none, its ``offset`` (NeMo's manifests time a row by
    ``offset`` and ``duration``: a NeMo row without an offset is read from 0, :func:`nemo_end`;
    a NeMo manifest's row at a negative offset from 0 too, :func:`nemo_offset`).

    Example:
        >>> start_of({"start": 2, "offset": 1}), start_of({"offset": 0}), start_of({})
        (2, 0, None)
        >>> start_of({"audio_filepath": "a.wav", "offset": -0.5}), start_of({"offset": "-1"})
        (0.0, '-1')
    """
    start = fields.get("start")
    if start not in (None, ""):
        return start
    offset = fields.get("offset")
    return nemo_offset(offset) if has_value(fields, NEMO_INPUT) else offset


def nemo_offset(value: Any) -> Any:
    """A NeMo manifest row's ``offset`` as NeMo's ``AudioSegment.from_file`` reads it: it
    seeks only ``if offset > 0``, so a negative offset reads from 0 (``0.0``); any other
    value as written (checked as seconds where it is read). Only a NeMo manifest's row (an
    ``audio_filepath``, :data:`NEMO_INPUT`) is read so: a negative offset in any other row
    is refused.

    Example:
        >>> nemo_offset(-0.25), nemo_offset("-1"), nemo_offset(1.5), nemo_offset(None)
        (0.0, 0.0, 1.5, None)
    """
    return 0.0 if below_zero(value) else value


def end_of(fields: Mapping[str, Any]) -> Any:
    """A row's ``end``, or, where it has none, its start (:func:`start_of`) ``+ duration`` (a
    segment timed as lhotse times cuts and supervisions), or a NeMo row's end
    (:func:`nemo_end`: from its offset, or 0, for its duration; to the recording's end for a
    duration of 0 or less). A ``duration`` without a start in any other row is a label of the
    whole file, not a bound.

    Example:
        >>> end_of({"start": "1.5", "duration": 2}), end_of({"duration": 2}), end_of({"end": 3})
        (3.5, None, 3)
        >>> end_of({"offset": 0, "duration": 1.25}), end_of({"offset": 1, "duration": 0})
        (1.25, None)
        >>> end_of({"audio_filepath": "a.wav", "duration": 2})
        2.0

    Raises:
        BadRow: the start, offset or duration is not seconds.
    """
    end, start, duration = fields.get("end"), start_of(fields), fields.get("duration")
    if end not in (None, "") or duration in (None, ""):
        return end
    if row_rule(fields) is SampleRule.NEMO:
        return nemo_end(start, duration)
    return end if start in (None, "") else seconds(start, "start") + seconds(duration, "duration")


def nemo_duration(value: Any) -> float | None:
    """A NeMo row's ``duration`` as NeMo's ``AudioSegment.from_file`` reads it: the seconds
    it reads (``read(int(duration * rate))`` where ``duration > 0``), or None where it reads
    to the recording's end (none given, or 0 or less: NeMo's "the whole file").

    Example:
        >>> nemo_duration("1.5"), nemo_duration(0), nemo_duration(-1), nemo_duration(None)
        (1.5, None, None, None)

    Raises:
        BadRow: not a number of seconds (text, NaN, +infinity).
    """
    if value in (None, ""):
        return None
    return None if below_zero(value) else seconds(value, "duration") or None


def below_zero(value: Any) -> bool:
    """Whether a row's ``value`` is a number below 0, a CSV cell's text too (a bool, or what
    is no number, is not: read as seconds, it is refused naming it)."""
    try:
        return not isinstance(value, bool) and float(value) < 0
    except (TypeError, ValueError):
        return False


def nemo_end(offset: Any, duration: Any) -> float | None:
    """A NeMo row's end in seconds: its offset (none: 0, where NeMo's datasets pass
    ``offset=0``) plus its duration (:func:`nemo_duration`), or None (the recording's end)
    where NeMo reads to the end. Its samples are counted from the duration as written
    (:func:`row_span`), not from this sum.

    Example:
        >>> nemo_end(1, 0.5), nemo_end(None, "2"), nemo_end(1, 0), nemo_end("", -1)
        (1.5, 2.0, None, None)

    Raises:
        BadRow: the offset or the duration is not seconds.
    """
    first = 0.0 if offset in (None, "") else seconds(offset, "offset")
    length = nemo_duration(duration)
    return None if length is None else first + length


def has_value(fields: Mapping[str, Any], name: str) -> bool:
    """Whether a row holds a value in column ``name`` (an empty CSV cell holds none)."""
    return fields.get(name) not in (None, "")


def row_rule(fields: Mapping[str, Any]) -> SampleRule:
    """How a row's seconds become samples: the rule of the tool whose fields time it, so what
    is decoded is what that tool's loader reads. An ``end`` is featbake's own (nearest
    sample); ``start`` and ``duration`` are lhotse's (each counted half up, as its
    ``compute_num_samples``); ``offset`` without a ``start``, or a NeMo manifest's row (an
    ``audio_filepath``, :data:`NEMO_INPUT`) with neither ``start`` nor ``end``, is NeMo's (the
    offset and the duration each truncated, as its ``AudioSegment.from_file`` seeks and reads:
    NeMo's datasets pass every row's ``duration``, with an offset or from 0). A ``duration``
    alone in any other row (a plain list of files with their lengths) is a label.

    Example:
        >>> rows = [{"start": 1, "end": 2}, {"start": 1, "duration": 1}, {"offset": 1},
        ...         {"offset": 1, "duration": 1}, {"start": 1}, {"duration": 3},
        ...         {"audio_filepath": "a.wav", "duration": 3}]
        >>> [row_rule(r).value for r in rows]
        ['nearest', 'lhotse', 'nemo', 'nemo', 'nearest', 'nearest', 'nemo']
    """
    if has_value(fields, "end"):
        return SampleRule.NEAREST
    if has_value(fields, "start"):
        return SampleRule.LHOTSE if has_value(fields, "duration") else SampleRule.NEAREST
    nemo = has_value(fields, "offset") or has_value(fields, NEMO_INPUT)
    return SampleRule.NEMO if nemo else SampleRule.NEAREST


def row_span(fields: Mapping[str, Any]) -> Span | None:
    """The segment a manifest row names (None: the whole file), counted into samples by
    :func:`row_rule` from its ``duration`` as written where that rule times it so (a NeMo or
    lhotse row: ``offset + duration`` summed in floats is not what either tool reads).

    Example:
        >>> row_span({"audio_filepath": "a.wav", "duration": 0.30007})
        Span(start=0.0, end=0.30007, channel=None, rule=<SampleRule.NEMO: 'nemo'>, duration=0.30007)
        >>> row_span({"audio_filepath": "a.wav", "duration": 0}) is None  # NeMo: to the end
        True

    Raises:
        BadRow: a bad start, offset, end, duration or channel, or ``start >= end``.
    """
    rule = row_rule(fields)
    duration = row_duration(fields, rule)
    channel = channel_of(fields.get("channel"))
    return span_of(start_of(fields), end_of(fields), channel, rule, duration)


def row_duration(fields: Mapping[str, Any], rule: SampleRule) -> float | None:
    """The ``duration`` a row's samples are counted from by ``rule``, as written: lhotse's
    seconds, NeMo's read (:func:`nemo_duration`: None where it reads to the end); None for a
    row timed by its ``end`` (or not at all: a ``duration`` there is a label).

    Raises:
        BadRow: the duration is not seconds.
    """
    if rule is SampleRule.NEMO:
        return nemo_duration(fields.get("duration"))
    if rule is SampleRule.LHOTSE:
        return seconds(fields["duration"], "duration")
    return None


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
    file = input_file(fields[column], base, column)
    span = row_span(fields)
    ident = fields.get("id")
    named = segment_id(fields[column], named_span(fields, span)) if ident in (None, "") else ident
    carried = {k: v for k, v in fields.items() if k != column and k not in OWN_COLUMNS}
    return str(named), Item(file, span, where, carried)


def named_span(fields: Mapping[str, Any], span: Span | None) -> Span | None:
    """The span a row's default id names (:func:`segment_id`): its own, but a NeMo row without
    an ``offset`` that reads to the file's end (a ``duration`` of 0 or less) is named as its
    file (``@chN`` kept). One that reads ``duration`` seconds is named by them as a segment
    from 0 is: the same id for other samples would let a row whose file is gone, its duration
    edited since, be served the features of the old duration, and two rows of one file of
    other durations would be one id.

    Example:
        >>> nemo = {"audio_filepath": "a.wav", "duration": 2.5}
        >>> segment_id("a.wav", named_span(nemo, row_span(nemo)))
        'a.wav#0.0-2.5'
        >>> whole = {**nemo, "duration": 0}
        >>> segment_id("a.wav", named_span(whole, row_span(whole)))
        'a.wav'
    """
    if span is None or span.rule is not SampleRule.NEMO or has_value(fields, "offset"):
        return span
    return span_of(None, None, span.channel) if span.to_end else span


# == row_inputs ====================================================================================
class RowInputs:
    """The items a manifest lists, as a build's :class:`~featbake.encode.inputs.Inputs`.

    Subclasses parse their layout (:meth:`parse`); everything else is shared: scan order is
    the manifest's, each file is hashed once for all its rows, a segment decodes by seeking.
    """

    #: Each row's digest comes from a file read whole (its SHA-256, or a segment's derived from
    #: it), so an engine's workers may read and hash the files (``hash``'s ``digester``).
    hashed_anywhere: ClassVar[bool] = True
    #: Whether the layout takes a relative path from the working directory (Kaldi's
    #: ``wav.scp``, lhotse's cut sources), not from the manifest's folder.
    paths_from_workdir: ClassVar[bool] = False

    def __init__(
        self, data: str | os.PathLike[str], column: str | None = None, workdir: str = ""
    ) -> None:
        self.origin = resolve_path(data)
        self.column = column
        #: The folder relative paths are taken from, where the layout takes them from the
        #: working directory (:attr:`paths_from_workdir`): ``workdir`` (a root's record of its
        #: build's, :attr:`featbake.store.roots.Root.workdir`), else the working directory now;
        #: ``""`` where its paths do not depend on it.
        self.workdir = (workdir or os.getcwd()) if self.paths_from_workdir else ""
        self.workdir_recorded = bool(workdir)  # a build's, not this process's own
        #: The folder the root's last build took relative paths from, where a rebuild or a
        #: dataset opens the data from another working directory (set before the scan): a
        #: rebuild takes relative paths from there first, then from :attr:`workdir`
        #: (:meth:`tool_paths`), so it reads every file its last build read; a dataset takes
        #: them from there alone (:attr:`reads_here`).
        self.build_workdir = ""
        #: Whether a relative path may be taken from :attr:`workdir` where
        #: :attr:`build_workdir` is set: a rebuild's may, after the build's folder; a
        #: dataset's may not (:func:`~featbake.encode.inputs.read_as_built`): it takes
        #: relative paths from the build's folder alone, so it reads the files its root's
        #: build read, and a file gone from there is gone (served as built), not another file
        #: of the same name in this process's working directory.
        self.reads_here = True
        #: The folder the last scan took relative paths from, for a root to record: the
        #: build's (:attr:`build_workdir`) where every relative path found was found only
        #: there, or where relative paths were taken from it alone (a dataset never moves its
        #: root's record), else :attr:`workdir`.
        self.found_in = self.workdir
        self._finder: ToolPaths | None = None  # the last parse's, until its scan reads it
        self.items: dict[str, Item] = {}  # id -> item, in the manifest's order (after scan)
        self.by_path: dict[str, Item] = {}  # Item.where -> item

    @property
    def where(self) -> str:
        return self.origin

    def tool_paths(self, manifest: str) -> ToolPaths:
        """The finder of the files ``manifest`` names relative to the working directory (a
        parse's), kept until its scan reads where it found them (:attr:`found_in`): from the
        build's folder alone where the data is read as built (:attr:`reads_here` off: a
        dataset); from the build's folder first, then :attr:`workdir`, where a rebuild runs
        elsewhere while that folder is there (the files it built, not other files of the same
        names here: a rebuild that read one clip here and the rest there recorded this folder,
        and its datasets served the others as built after they changed there); else from
        :attr:`workdir` (the build's folder, if any, after it)."""
        if self.build_workdir and not self.reads_here:
            self._finder = ToolPaths(manifest, self.build_workdir, recorded=True)
        elif self.build_workdir and os.path.isdir(self.build_workdir):
            self._finder = ToolPaths(
                manifest, self.build_workdir, recorded=True, fallback=self.workdir
            )
        else:
            self._finder = ToolPaths(
                manifest, self.workdir, recorded=self.workdir_recorded, fallback=self.build_workdir
            )
        return self._finder

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
        finder, self._finder = self._finder, None  # not pickled into workers: a path per file
        if finder is not None:
            self.found_in = (
                finder.fallback if finder.at_fallback and not finder.here else finder.cwd
            )
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

    def carried(self, path: str) -> object | None:
        """Row ``path``'s item (file, span, effects): what a worker decodes it by; its carried
        columns left out (a worker never reads them, and a lhotse cut's can be large)."""
        item = self.by_path.get(path)
        return None if item is None else dataclasses.replace(item, row={})

    def carry(self, rows: Mapping[str, object]) -> dict[str, str]:
        """Take one task's rows' items (the table the source made from these inputs reads),
        in place of the last task's."""
        return replace_rows(self.by_path, rows, Item)

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
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Each row's digest (its file's SHA-256, or its segment's :func:`item_digest`), every
        file hashed once through the hash cache and its header read once for the bounds.
        The files the hash cache does not know are read by ``digester`` (default: here; an
        engine's cluster); the headers of segmented files are read here (a file's header, an
        object's first bytes).
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
        hold = held_files(items)
        digests, failed = hash_inputs(
            catalog, files, progress, file_stats, held, hold, digester=digester
        )
        spans = {it.file for it in items if it.span and not it.effects and it.file in digests}
        headers = audio_headers({f: digests[f] for f in sorted(spans)}, held)
        out: dict[str, str] = {}
        bad: dict[str, str] = {}
        for path, it in zip(paths, items, strict=True):
            header = headers.get(it.file) if it.span and not it.effects else None
            why = failed.get(it.file) or (header if isinstance(header, str) else None)
            if why is None and isinstance(header, AudioHeader):
                why = header.problem(it.span)
            if why is not None:
                bad[path] = f"{it.where}: {it.file}: {why}"
                continue
            stats[path] = file_stats[it.file]
            out[path] = row_digest(digests[it.file], it, header)
        if held is not None:
            good = {p: it.file for p, it in zip(paths, items, strict=True) if p in out}
            held_by_row(held, [f for f in files if f in hold], good)
        return out, bad

    def source(self, inner: Source) -> Source:
        return SegmentSource(inner, self.by_path)


def replace_rows(table: dict[str, T], rows: Mapping[str, object], kind: type[T]) -> dict[str, str]:
    """``table`` (a worker's row table, which its source reads) made ``rows``, each a ``kind``
    (one task's carried rows in place of the last's); nothing refused.

    Raises:
        TypeError: a row carries something else (a bug: the driver carried it).
    """
    if not all(isinstance(v, kind) for v in rows.values()):
        raise TypeError(f"a row carries a {kind.__name__}, not what was sent")
    table.clear()
    table.update(cast(Mapping[str, T], rows))
    return {}


def held_files(items: Sequence[Item]) -> set[str]:
    """The files whose bytes a first build keeps from hashing them to decode their rows (read
    once, issue 31 item 3): a file a row names whole, its segment rows too (a span decoded
    from the bytes in memory), since its whole-file row decodes all of it anyway; and an
    input whose place reads it whole to decode any part (an object: its segments decode from
    the bytes of the GET that hashed it). A file named by segment rows only is hashed
    streamed and its segments decoded by seeking: holding a long recording whole is what
    segments exist to avoid."""
    return {it.file for it in items if it.span is None or not bytes_at(it.file).seeks}


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


#: The kind :func:`segment_digest` hashes under: ``segment-v2`` keys sample bounds at the
#: file's own rate (``segment``, before, hashed the bounds' float seconds).
SEGMENT_KIND = "segment-v2"
#: The kind of a lhotse cut decoded by lhotse (its recording's transforms in the key).
LHOTSE_KIND = "lhotse-transformed-v1"


def row_digest(file_sha256: str, item: Item, header: AudioHeader | str | None) -> str:
    """A row's digest: its file's (a whole file), its segment's (:func:`segment_digest`), or
    its lhotse cut's (the file, the transforms, the bounds in samples after them)."""
    if item.effects is not None:
        first, last = item.effects.bounds()
        channel = item.effects.channel
        parts = (item.effects.transforms, item.effects.rate, first, last, repr(channel))
        return item_digest(LHOTSE_KIND, file_sha256, *parts)
    if item.span is None:
        return file_sha256
    assert isinstance(header, AudioHeader)  # a segment's file's header was read, or it failed
    return segment_digest(file_sha256, item.span, header)


def segment_digest(file_sha256: str, span: Span, header: AudioHeader) -> str:
    """The digest of a segment of a file: its file's digest, its first and past-the-last
    sample at the file's own rate (what is decoded: a lhotse cut, a Kaldi segment and a
    manifest row naming the same samples share it, however their seconds are written), and
    its channel. A segment to the file's end is keyed by no end; one of all of a file's
    samples and channels is the file (its digest). A mono file's channel 0 is the file.

    ``header.frames`` is None for an object in a bucket (its header read from its first
    bytes): its end is its own bound, its file's end is not looked up.

    Example:
        >>> sha = "ab" * 32
        >>> a = segment_digest(sha, Span(0.1 + 0.2, 1.0), AudioHeader(16000, 16000, 1))
        >>> a == segment_digest(sha, Span(0.3, 1.0), AudioHeader(16000, 16000, 1))
        True
        >>> segment_digest(sha, Span(0.0, 1.0), AudioHeader(16000, 16000, 1)) == sha
        True
    """
    total = header.frames if header.frames is not None else -1
    first, last = span.frames(header.rate, total)
    end = None if span.to_end or last == header.frames else last
    channel = None if header.channels == 1 else span.channel
    if first == 0 and end is None and channel is None:
        return file_sha256
    return item_digest(SEGMENT_KIND, file_sha256, header.rate, first, end, channel)


@dataclass(frozen=True)
class AudioHeader:
    """A recording's header: what a segment's bounds are checked against (``frames`` None:
    not known, an object's header read from its first bytes; checked when decoded)."""

    frames: int | None
    rate: int
    channels: int

    def problem(self, span: Span | None) -> str | None:
        if span is None or self.frames is None:
            return None
        return span_problem(span, self.frames, self.rate, self.channels)


#: Bytes of an input's head read for its header (rate, channels) when its bytes are not held
#: and its place does not seek (an object: one ranged GET, not the whole object).
HEADER_BYTES = 64 << 10
#: (input, its digest) -> its header, read once per process.
_HEADERS: dict[tuple[str, str], AudioHeader] = {}


def audio_headers(files: Mapping[str, str], held: HeldBytes | None) -> dict[str, AudioHeader | str]:
    """file -> its header, or why it cannot be read as audio (``files``: file -> its digest):
    from the bytes ``held`` keeps for it, else read through its place: a file's opened (its
    frames known, every segment's bounds checked now), an object's first
    :data:`HEADER_BYTES` by one ranged GET, once per process and digest (its frames unknown:
    its segments' bounds are checked when they are decoded)."""
    out: dict[str, AudioHeader | str] = {}
    for file, sha in files.items():
        known = _HEADERS.get((file, sha))
        if known is None:
            got = audio_header(file, held.peek(file) if held is not None else None)
            if isinstance(got, AudioHeader) and got.frames is None:
                _HEADERS[file, sha] = got
            out[file] = got
        else:
            out[file] = known
    return out


def audio_header(file: str, kept: bytes | None) -> AudioHeader | str:
    """One file's header (from ``kept``, its bytes, if given), or why it cannot be read."""
    import soundfile

    place = bytes_at(file)
    # An input not read by seeking has its frames unknown, whether its head or all of it is
    # at hand: the same key either way (a segment to its end is keyed by its end in samples).
    whole = place.seeks
    try:
        if kept is None and not place.seeks:
            kept = place.read_range(file, 0, HEADER_BYTES)
    except SourceError as e:
        return str(e).removeprefix(f"{file}: ")
    opened: Any = file if kept is None else io.BytesIO(kept)
    try:
        info = soundfile.info(opened)
    except (soundfile.LibsndfileError, RuntimeError, OSError) as e:
        why = str(e).strip().replace(repr(opened), repr(file)) or type(e).__name__
        return f"cannot read its audio header ({why})"
    frames = int(info.frames) if whole else None
    return AudioHeader(frames, int(info.samplerate), int(info.channels))


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
        if item.effects is not None:
            try:
                return self.inner.load(file, lhotse_wav(item.effects))
            except SourceError as e:
                raise SourceError(f"{path}: {e}") from None
        if data is None and not bytes_at(file).seeks:  # read whole once for its segments
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
        if item is not None and not bytes_at(item.file).seeks:  # checked by the read's stat
            got = self.objects.get(item.file, path)
            if stat is None or got.stat != stat:
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
        self.held: ByteLRU[str, Whole] = ByteLRU(OBJECT_CACHE_BYTES, lambda o: len(o.data))
        self.lock = threading.Lock()

    def get(self, url: str, path: str | os.PathLike[str]) -> Whole:
        """Object ``url``'s bytes and the stat they came with (``path``: the row, for messages).

        Raises:
            SourceError: it is gone or cannot be read.
        """
        with self.lock:
            got = self.held.get(url)
        if got is not None:
            return got
        try:
            read = bytes_at(url).read(url)
        except SourceError as e:
            raise SourceError(f"{path}: {e}") from None
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
        bases = RowsBase(os.path.dirname(self.origin))
        name = os.path.basename(self.origin)
        parsed = Parsed()
        seen = ColumnsSeen(column)
        for line, fields in manifest_records(self.origin):
            where = f"{self.origin}:{line}"
            try:
                if isinstance(fields, BadRow):
                    raise fields
                if not seen.rows:
                    refuse_lhotse_set(self.origin, fields, column)
                seen.note(fields)
                base = bases.for_value(fields.get(column))
                parsed.items.append(manifest_item(fields, column, base, where))
            except BadRow as e:
                parsed.skipped.append(SkippedInput(f"{name}:{line}", str(e)))
        seen.check(self.origin, "name the input with --column")
        return parsed


def lhotse_set_of(fields: Mapping[str, Any]) -> str | None:
    """The lhotse manifest a row is of, other than cuts (``RecordingSet``: its ``sources``,
    ``SupervisionSet``: a ``recording_id`` timed by ``start`` and ``duration``), or None.

    Example:
        >>> lhotse_set_of({"id": "r", "sources": [], "sampling_rate": 16000, "num_samples": 8})
        'RecordingSet'
        >>> lhotse_set_of({"id": "s", "recording_id": "r", "start": 0.5, "duration": 1.0})
        'SupervisionSet'
        >>> lhotse_set_of({"path": "a.wav", "start": 0.5, "duration": 1.0}) is None
        True
    """
    if isinstance(fields.get("sources"), list) and "sampling_rate" in fields:
        return "RecordingSet"
    if {"recording_id", "start", "duration"} <= fields.keys():
        return "SupervisionSet"
    return None


def refuse_lhotse_set(origin: str, fields: Mapping[str, Any], column: str) -> None:
    """Refuse a lhotse recordings or supervisions manifest given as ``--data`` (its first row
    lacks ``column``, or holds lhotse's list of sources there): the rows name no audio
    featbake can read, and the advice to name another column failed on every row. A row of
    one's own that holds the column (a null path too) is read as rows are.

    Raises:
        SourceError: ``fields`` is such a row.
    """
    kind = lhotse_set_of(fields)
    held = fields.get(column)
    if kind is None or (column in fields and not isinstance(held, (list, dict))):
        return  # a row of the user's own (a bad value is that row's error)
    raise SourceError(
        f"{origin} is a lhotse {kind} manifest, not a cut manifest: featbake reads cuts; "
        "make them with CutSet.from_manifests(recordings=..., supervisions=...)"
        ".to_file('cuts.jsonl.gz') and pass that as --data"
    )


class RowsBase:
    """The folder a manifest's relative paths are taken from: the manifest's own, or, where
    its first relative path is not there but is in ``clips/`` beside it, that folder (Common
    Voice's layout: ``validated.tsv`` names each clip by its file name, the clips lie in
    ``clips/``). Decided once, at the first relative local path (two stats a manifest).

    Args:
        folder: the manifest's folder.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.chosen: str | None = None

    def for_value(self, value: Any) -> str:
        """The folder to take ``value`` (a row's input cell) from."""
        if self.chosen is not None:
            return self.chosen
        if not isinstance(value, str) or not value or value.startswith(("/", "~")):
            return self.folder
        if "://" in value:  # a URL (read, or refused by its row)
            return self.folder
        clips = os.path.join(self.folder, COMMON_VOICE_CLIPS)
        beside = os.path.exists(os.path.join(self.folder, value))
        in_clips = not beside and os.path.isfile(os.path.join(clips, value))
        self.chosen = clips if in_clips else self.folder
        return self.chosen


#: Where Common Voice keeps the clips its TSVs name by file name, beside the TSVs.
COMMON_VOICE_CLIPS = "clips"
#: How manifests are decoded: UTF-8, less the byte-order mark Excel's "CSV UTF-8" (and Notepad)
#: writes first, which plain ``utf-8`` kept as part of the first column's name.
MANIFEST_ENCODING = "utf-8-sig"
#: The rows whose columns a "no such column" message lists (the columns a manifest has).
COLUMNS_FROM_ROWS = 20


def manifest_records(
    path: str, errors: str = "strict"
) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
    """(line number, fields or why the line is not a row) of each row of a JSONL, CSV or TSV
    manifest (by its name's ending), decoded as :data:`MANIFEST_ENCODING` with ``errors``.

    Raises:
        SourceError: the manifest does not exist or cannot be read (or decoded, with
            ``errors="strict"``).
    """
    lower = path.lower().removesuffix(".gz")  # a compressed manifest is read as its kind
    try:
        with open_manifest(path, errors) as f:
            if lower.endswith(".json"):
                yield from json_lines_records(f, path)
            elif lower.endswith(".jsonl"):
                yield from json_records(f)
            else:
                yield from table_records(f, "\t" if lower.endswith(".tsv") else ",")
    except FileNotFoundError:
        raise SourceError(f"manifest {path} does not exist") from None
    except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
        raise SourceError(f"manifest {path} cannot be read ({e})") from None


def open_manifest(path: str, errors: str) -> TextIO:
    """A manifest's text: one named ``*.gz`` (``rows.jsonl.gz``, ``rows.csv.gz``) decompressed
    as it is read, others as they are.

    Raises:
        OSError: the file cannot be opened.
    """
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding=MANIFEST_ENCODING, errors=errors, newline="")
    return open(path, encoding=MANIFEST_ENCODING, errors=errors, newline="")


@dataclass
class ColumnsSeen:
    """Whether any row of a manifest holds ``column``, and the columns its first rows hold.

    A column no row holds (``--column`` mistyped, or the default ``path`` where the manifest
    calls it ``audio``) is the command's mistake, not each row's: one line before any work
    (:meth:`check`), as a table without the column is
    (:meth:`featbake.encode.tables.Table.no_column`), not a bad row per row.
    """

    column: str
    found: bool = False
    rows: int = 0
    names: dict[str, None] = field(default_factory=dict)  # in order, from the first rows

    def note(self, fields: Mapping[str, Any]) -> None:
        """Count a row (a JSON object or a table's record) and its columns."""
        self.found = self.found or self.column in fields
        if self.rows < COLUMNS_FROM_ROWS:
            self.names.update(dict.fromkeys(str(k) for k in fields))
        self.rows += 1

    def check(self, where: str, fix: str) -> None:
        """Refuse the manifest if it has rows and none holds the column.

        Raises:
            ColumnMissing: no row holds the column (the message lists the columns there are).
        """
        if self.found or not self.rows:
            return
        listed = ", ".join(self.names) or "none"
        raise ColumnMissing(
            f"{where} has no column {self.column!r} in any row (columns: {listed}); {fix}",
            tuple(self.names),
        )


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


def json_lines_records(
    lines: Iterator[str] | Any, path: str
) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
    """:func:`json_records` of a ``.json`` manifest, which must be JSON lines (NeMo names its
    manifests ``.json``): its first non-blank line a whole JSON object.

    Raises:
        SourceError: the first line is not one (a JSON document over several lines: every line
            would be a bad row, the command's mistake rather than each row's).
    """
    records = json_records(lines)
    first = next(records, None)
    if first is not None and isinstance(first[1], BadRow):
        raise SourceError(
            f"{path} is not JSON lines (its first line is not a whole JSON object); a .json "
            "manifest holds one object per line, as NeMo writes them: write it so, or as .jsonl"
        )
    if first is not None:
        yield first
    yield from records


class NumberedLines:
    """A file's lines, handed one at a time to a :func:`csv.reader`, counting them: the line a
    record starts on (a quoted CSV cell may hold line breaks), and where to read on from."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        self.at = 0  # the index of the next line to hand out: lines read so far

    def __iter__(self) -> NumberedLines:
        return self

    def __next__(self) -> str:
        if self.at >= len(self.lines):
            raise StopIteration
        self.at += 1
        return self.lines[self.at - 1]


class UnquotedTSV(csv.excel_tab):
    """A TSV manifest's dialect: tab-separated, a quote mark is text (nothing is quoted)."""

    quoting = csv.QUOTE_NONE


class StrictCSV(csv.excel):
    """A CSV manifest's dialect: as Excel writes it, a malformed quote an error (not a cell run
    on to the next closing quote)."""

    strict = True


def table_records(f: Any, delimiter: str) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
    """(line number, record) per row of a CSV/TSV file with a header line; each record names
    the line it starts on.

    **A TSV is not quoted** (:data:`csv.QUOTE_NONE`): a quote mark in a tab-separated manifest
    is text (Common Voice's sentences open quotes), where CSV quoting made a sentence opening
    one a cell that ran over the next rows: rows vanished without a line and a row got another
    row's label. **A CSV is quoted as Excel writes it** (a quoted cell may hold commas, quotes
    doubled and line breaks), strictly: a quote left open, or text after a closing quote, is a
    bad row at the line it starts on, and reading goes on at the line after it (the rows such
    a quote swallowed are each read, not lost). Either way a row with more or fewer fields than
    the header is a bad row, never padded or merged.

    Raises:
        SourceError: the header line is malformed.
    """
    tsv = delimiter == "\t"
    kind = "TSV" if tsv else "CSV"
    lines = NumberedLines(f.readlines())
    dialect = UnquotedTSV if tsv else StrictCSV
    header: list[str] | None = None
    while lines.at < len(lines.lines):
        start = lines.at
        reader = csv.reader(lines, dialect)
        try:
            for fields in reader:
                if header is None:
                    header = fields or None  # blank lines before the header are no header
                elif fields:  # a blank line is no row
                    yield start + 1, table_record(header, fields)
                start = lines.at
        except csv.Error as e:
            if header is None:
                where = getattr(f, "name", "the manifest")
                raise SourceError(f"{where}:{start + 1}: not a {kind} header ({e})") from None
            yield start + 1, BadRow(f"malformed {kind} ({e})")
            lines.at = start + 1  # read on from the line after the one the record starts on


def table_record(header: list[str], fields: list[str]) -> dict[str, str] | BadRow:
    """A table row's fields by the header's names, or why its field count is not the header's."""
    if len(fields) > len(header):
        return BadRow(f"more fields than the header names ({len(fields)}, not {len(header)})")
    if len(fields) < len(header):
        return BadRow(f"fewer fields than the header names ({len(fields)}, not {len(header)})")
    return dict(zip(header, fields, strict=True))


# == kaldi =========================================================================================
class KaldiInputs(RowInputs):
    """A Kaldi data folder: ``wav.scp`` (+ ``segments``, ``text``, ``utt2spk``)."""

    paths_from_workdir = True

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
            for rec, got in recordings.items():
                if isinstance(got, Placed):
                    parsed.items.append(
                        (rec, Item(got.file, None, got.where, kaldi_row(rec, carried)))
                    )
                else:
                    parsed.skipped.append(SkippedInput(got.where, f"recording {rec}: {got.why}"))
            return parsed
        for line, fields in kaldi_lines(segments):
            where = f"{segments}:{line}"
            try:
                parsed.items.append(segment_item(fields, recordings, where, carried))
            except BadRow as e:
                parsed.skipped.append(SkippedInput(f"segments:{line}", str(e)))
        return parsed

    def _recordings(self, parsed: Parsed) -> dict[str, Placed | Unplaced]:
        """recording id -> its file and where wav.scp names it (or why its file is not taken:
        each of its segments fails with that); a piped entry refuses the folder.

        Raises:
            SourceError: an entry is a command (``cmd |``), not a file, or a recording id is
                on two lines (which file its segments are cut from would be a guess).
        """
        scp = os.path.join(self.origin, "wav.scp")
        out: dict[str, Placed | Unplaced] = {}
        first_lines: dict[str, int] = {}
        paths = self.tool_paths(scp)
        for line, fields in kaldi_lines(scp):
            if len(fields) < 2:
                parsed.skipped.append(SkippedInput(f"wav.scp:{line}", "no file after the id"))
                continue
            rec, value = fields[0], " ".join(fields[1:])
            if rec in first_lines:
                raise SourceError(
                    f"recording id {rec!r} is on lines {first_lines[rec]} and {line} of {scp}; "
                    "ids must be unique (Kaldi's validate_data_dir.sh refuses it too): give "
                    "each recording its own id"
                )
            first_lines[rec] = line
            if value.endswith("|"):
                raise SourceError(
                    f"{scp}:{line}: recording {rec} is a command ({value!r}), and featbake "
                    "reads files only: run each command once to write a wav file (e.g. `sox "
                    "in.sph out.wav`) and point wav.scp at the files"
                )
            try:
                out[rec] = Placed(paths.file(value), f"{scp}:{line}")
            except BadRow as e:
                out[rec] = Unplaced(f"wav.scp:{line}", str(e))
        return out


class Placed(NamedTuple):
    """A ``wav.scp`` recording's file (absolute) and its line (``.../wav.scp:3``)."""

    file: str
    where: str


class Unplaced(NamedTuple):
    """A ``wav.scp`` recording whose file is not taken: its line (``wav.scp:3``) and why."""

    where: str
    why: str


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
    recordings: Mapping[str, Placed | Unplaced],
    where: str,
    carried: Mapping[str, Mapping[str, str]],
) -> tuple[str, Item]:
    """(utterance id, item) of one ``segments`` line: ``utt rec start end [channel]`` (the
    channel, as Kaldi's ``extract-segments`` takes it, picks one channel of the recording).

    Raises:
        BadRow: not four or five fields, an unknown recording, bad times or a bad channel.
    """
    if len(fields) not in (4, 5):
        raise BadRow(f"{len(fields)} fields, not 4 (utterance recording start end [channel])")
    utt, rec, start, end = fields[:4]
    channel = kaldi_channel(fields[4]) if len(fields) == 5 else None
    placed = recordings.get(rec)
    if placed is None:
        raise BadRow(f"recording {rec!r} is not in wav.scp")
    if isinstance(placed, Unplaced):
        raise BadRow(f"recording {rec} ({placed.where}): {placed.why}")
    row = {"recording": rec, **kaldi_row(utt, carried)}
    span = span_of(start, None if kaldi_to_end(end) else end, channel)
    return utt, Item(placed.file, span, where, row)


def kaldi_channel(field: str) -> int:
    """A ``segments`` line's fifth field: the channel, a whole number from 0.

    Raises:
        BadRow: it is not one.
    """
    try:
        channel = int(field)
    except ValueError:
        channel = -1
    if channel < 0:
        raise BadRow(f"channel {field!r} is not a channel number (0, 1, ...)")
    return channel


def kaldi_to_end(end: str) -> bool:
    """Whether a ``segments`` end is Kaldi's "to the end of the recording": the number -1,
    however it is written (``extract-segments`` compares the parsed number, so ``-1.00`` from
    a ``%.2f`` writer means it too); the span's end is then the file's.

    Example:
        >>> [kaldi_to_end(e) for e in ("-1", "-1.00", "-1e0", "1.00", "-1.5", "x")]
        [True, True, True, False, False, False]
    """
    try:
        return float(end) == -1.0
    except ValueError:
        return False  # not a number: the span says so


# == cuts ==========================================================================================
class CutsInputs(RowInputs):
    """A lhotse cut manifest (``cuts.jsonl.gz``): read with gzip and json; a cut whose
    recording has ``transforms`` is decoded by lhotse itself (see :class:`LhotseAudio`)."""

    paths_from_workdir = True

    def parse(self) -> Parsed:
        if self.column is not None:
            raise SourceError(
                f"--column {self.column} names a manifest column; a lhotse cut manifest "
                f"({self.origin}) names its audio in recording.sources: drop --column"
            )
        name = os.path.basename(self.origin)
        parsed = Parsed()
        paths = self.tool_paths(self.origin)
        try:
            with cut_lines(self.origin) as f:
                for line, cut in json_records(f):
                    try:
                        if isinstance(cut, BadRow):
                            raise cut
                        where = f"{self.origin}:{line}"
                        parsed.items.append(cut_item(cut, paths, where))
                    except BadRow as e:
                        parsed.skipped.append(SkippedInput(f"{name}:{line}", str(e)))
        except FileNotFoundError:
            raise SourceError(f"cut manifest {self.origin} does not exist") from None
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
            raise SourceError(f"cut manifest {self.origin} cannot be read ({e})") from None
        return parsed


def cut_lines(path: str) -> TextIO:
    """A cut manifest's lines: gzip-compressed (``cuts.jsonl.gz``) or plain (lhotse writes
    ``cuts.jsonl`` uncompressed), told by the file's first bytes as gzip tells them.

    Raises:
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        compressed = gzip_compressed(f)
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8-sig")


@dataclass(frozen=True)
class CutSource:
    """The one recording source a cut reads: its file (absolute) and the channel to pick
    from it (None: all of the file's channels, mixed as the recipe says)."""

    file: str
    picked: int | None


#: The lhotse source types read: a file, and a URL (lhotse's type for a recording in a
#: bucket: ``s3://``, ``gs://``, ``az://`` are read as a manifest's rows are; others are refused
#: by their row, naming the schemes read).
SOURCE_TYPES_READ = ("file", "url")


def cut_source(rec: Mapping[str, Any], channel: Any, paths: ToolPaths) -> CutSource:
    """The source holding a cut's channel(s), as lhotse's ``Recording.load_audio`` picks it:
    each source holds the channels its ``channels`` lists (AMI, CHiME: one file per channel),
    and a channel is the file's channel at its index in that list.

    Raises:
        BadRow: no file source holds the channel, or the cut takes channels of several
            sources (lhotse stacks them; featbake encodes one file's channel or mix).
    """
    sources = [s for s in rec.get("sources") or [] if isinstance(s, Mapping)]
    wanted = channel if isinstance(channel, list) else None if channel is None else [channel]
    holding = [s for s in sources if wanted is None or set(wanted) & set(s.get("channels") or [0])]
    if len(holding) > 1:
        held = "; ".join(f"{s.get('channels')} in {s.get('source')}" for s in holding)
        raise BadRow(
            f"the cut takes channels {wanted if wanted is not None else 'all'} of {len(holding)} "
            f"sources ({held}), and featbake encodes one source's channel or mix: make a cut per "
            "channel (cut.with_channels(c))"
        )
    if not holding:
        raise BadRow(f"no source of the recording holds channel {channel}")
    source = holding[0]
    if source.get("type") not in SOURCE_TYPES_READ:
        raise BadRow(
            f"channel {channel} is in a source of type {source.get('type')}, not file or url"
        )
    file = paths.file(source.get("source"))
    channels = list(source.get("channels") or [0])
    if wanted is None or sorted(wanted) == sorted(channels):
        return CutSource(file, None)
    if len(wanted) > 1:
        raise BadRow(f"channels {wanted} of {channels}: a cut of several channels of one file")
    return CutSource(file, channel_of(channels.index(wanted[0])))


class ToolPaths:
    """The files a cut manifest's sources (or a ``wav.scp``'s entries) name, as lhotse and
    Kaldi find them: a relative path is taken from the working directory (icefall keeps
    ``download/...`` paths in cuts under ``data/fbank/``), not from the manifest's folder.
    One per parse: each distinct path is looked at once, however many cuts name it.

    Args:
        manifest: the cut manifest or ``wav.scp`` (its folder is where a user may have meant).
        workdir: the folder relative paths are taken from (``""``: the working directory).
        recorded: ``workdir`` is the one a build ran in, as its root records it
            (:attr:`featbake.store.roots.Root.workdir`): the data is opened again, maybe from
            elsewhere (a bad row's line names it so).
        fallback: the folder a relative path missing from ``workdir`` is taken from, where
            it is not ``workdir``: a rebuild's own working directory, after the folder its
            root's last build read (``workdir``, which a rebuild reads first: the files it
            built, not other files of the same names here), for a row naming a file only
            this directory holds. A dataset is given none: it reads the recorded folder alone.
    """

    def __init__(
        self, manifest: str, workdir: str = "", *, recorded: bool = False, fallback: str = ""
    ) -> None:
        self.manifest = manifest
        self.recorded = recorded
        self.cwd = workdir or os.getcwd()
        self.fallback = fallback if fallback and fallback != self.cwd else ""
        self.seen: dict[str, str | BadRow] = {}
        #: The absolute files taken from :attr:`fallback` (found there, not from :attr:`cwd`).
        self.at_fallback: set[str] = set()
        self.here = 0  # relative paths found from :attr:`cwd`

    def file(self, value: Any) -> str:
        """The absolute file ``value`` names.

        Raises:
            BadRow: not a path, or a relative path missing from the working directory that
                the manifest's folder holds (run from the folder the paths are relative to).
        """
        got = self.seen.get(value) if isinstance(value, str) else None
        if got is None:
            try:
                got = self._placed(value)
            except BadRow as e:
                got = e
            if isinstance(value, str):
                self.seen[value] = got
        if isinstance(got, BadRow):
            raise BadRow(str(got))
        return got

    def folder_of(self, file: str) -> str:
        """The folder ``file``'s relative path was taken from (:attr:`fallback` or
        :attr:`cwd`)."""
        return self.fallback if file in self.at_fallback else self.cwd

    def _placed(self, value: Any) -> str:
        file = input_file(value, self.cwd, "recording.sources[].source")
        absolute = os.path.isabs(os.path.expanduser(value))
        if bytes_at(file).remote or absolute:
            return file
        if os.path.exists(file):
            self.here += 1
            return file
        if self.fallback:
            other = input_file(value, self.fallback, "recording.sources[].source")
            if os.path.exists(other):
                self.at_fallback.add(other)
                return other
        folder = os.path.dirname(self.manifest)
        beside = os.path.normpath(os.path.join(folder, value))
        if os.path.exists(beside):
            where = "the build's working directory" if self.recorded else "the working directory"
            raise BadRow(
                f"{value} is not in {where} ({self.cwd}), which relative paths "
                f"are taken from as lhotse and Kaldi take them, but is beside the manifest "
                f"({beside}): run from {folder} or write absolute paths"
            )
        return file


def cut_item(cut: Mapping[str, Any], paths: ToolPaths, where: str) -> tuple[str, Item]:
    """(cut id, item) of one lhotse cut: the source holding its channel, its start and
    duration; a recording with ``transforms`` (speed, volume) decoded by lhotse.

    Raises:
        BadRow: no id or recording, no file source holds the channel, bad times, or
            transforms without lhotse installed.
    """
    rec = cut.get("recording")
    if isinstance(cut.get("tracks"), list) and "id" in cut:
        raise BadRow(
            f"cut {cut['id']} is a {cut.get('type', 'MixedCut')} (a padded or mixed cut: "
            "`.pad()`, `.mix()`, `.append()`), whose audio featbake does not make; build the "
            "cuts before padding them (pad the features when batching: pad_collate)"
        )
    if not isinstance(rec, Mapping) or "id" not in cut:
        raise BadRow("not a cut (no id or recording); featbake reads MonoCut lines")
    try:
        source = cut_source(rec, cut.get("channel"), paths)
        start = seconds(cut.get("start", 0.0), "start")
        duration = cut.get("duration")  # none: to the recording's end
        length = None if duration is None else seconds(duration, "duration")
        end = None if length is None else start + length
        span = span_of(start, end, source.picked, SampleRule.LHOTSE, length)
        effects = (
            lhotse_audio(cut, rec, source.file, paths.folder_of(source.file))
            if rec.get("transforms")
            else None
        )
    except BadRow as e:
        raise BadRow(f"cut {cut['id']}: {e}") from None
    return str(cut["id"]), Item(source.file, span, where, cut_row(cut), effects)


#: What a cut's first supervision names that a cut's row carries under the same key.
SUPERVISION_KEYS = ("speaker", "language", "gender")


def cut_row(cut: Mapping[str, Any]) -> dict[str, Any]:
    """A cut's carried columns: its recording's id; its supervisions' texts (joined by a space);
    the first supervision's speaker, language and gender; and the ``custom`` fields of its
    supervisions and of the cut itself (labels a recipe attached: ``cut.custom["label"]``),
    the cut's last. featbake's own keys are never replaced by a custom field of that name.

    Example:
        >>> cut_row({"recording": {"id": "r"}, "custom": {"label": 3},
        ...          "supervisions": [{"text": "hi", "language": "en"}]})
        {'label': 3, 'recording': 'r', 'text': 'hi', 'language': 'en'}
    """
    sups = [s for s in cut.get("supervisions") or [] if isinstance(s, Mapping)]
    custom: dict[str, Any] = {}
    for fields in [s.get("custom") for s in sups] + [cut.get("custom")]:
        if isinstance(fields, Mapping):
            custom.update(fields)
    row: dict[str, Any] = {**custom, "recording": cut["recording"].get("id")}
    texts = [str(s["text"]) for s in sups if s.get("text")]
    if texts:
        row["text"] = " ".join(texts)
    for key in SUPERVISION_KEYS:
        named = [s[key] for s in sups if s.get(key)]
        if named:
            row[key] = named[0]
    return row


# == lhotse_audio ==================================================================================
@dataclass(frozen=True)
class LhotseAudio:
    """A cut whose recording has ``transforms`` (``perturb_speed``, ``perturb_volume``):
    decoded by lhotse's own ``Recording.load_audio`` (the transforms applied exactly as lhotse
    applies them), then mixed, resampled and normalised by the recipe as any file.

    ``recording`` is the recording's JSON with each file source's path made absolute;
    ``transforms`` (canonical JSON) and the bounds in samples at ``rate`` (the recording's
    rate, after its transforms) enter the key."""

    recording: str
    channel: int | tuple[int, ...] | None
    start: float
    duration: float | None
    rate: int
    transforms: str

    def load(self) -> np.ndarray:
        """``[C, T]`` float32 samples of the cut as lhotse's ``cut.load_audio()`` gives them.

        Raises:
            SourceError: lhotse cannot load it.
        """
        from lhotse import Recording

        channel = list(self.channel) if isinstance(self.channel, tuple) else self.channel
        try:
            rec = Recording.from_dict(json.loads(self.recording))
            audio = rec.load_audio(channels=channel, offset=self.start, duration=self.duration)
        except Exception as e:  # lhotse raises plain exceptions (AssertionError, ValueError...)
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SourceError(f"lhotse cannot load the cut's audio ({why})") from None
        return np.asarray(audio, dtype=np.float32)

    def bounds(self) -> tuple[int, int | None]:
        """The cut's first and past-the-last sample at the recording's rate (None: to its end),
        as lhotse's ``load_audio`` counts them: two cuts lhotse reads apart are keyed apart."""
        return lhotse_bounds(self.start, self.duration, self.rate)


def lhotse_audio(
    cut: Mapping[str, Any], rec: Mapping[str, Any], file: str, workdir: str
) -> LhotseAudio:
    """The lhotse decoding of a cut with transforms; its file sources' relative paths taken
    from ``workdir`` (:attr:`ToolPaths.cwd`: where the cut's own source was found).

    Raises:
        BadRow: lhotse is not installed, the source is in a bucket, or no sampling rate.
    """
    transforms = json.dumps(rec["transforms"], sort_keys=True, separators=(",", ":"))
    if importlib.util.find_spec("lhotse") is None:
        raise BadRow(
            f"recording transforms ({transform_names(rec['transforms'])}) are applied by "
            "lhotse's own code: pip install lhotse, or drop the perturbed cuts"
        )
    if bytes_at(file).remote:
        raise BadRow("recording transforms of a source in a bucket are not read; copy it locally")
    rate = rec.get("sampling_rate")
    if not isinstance(rate, int) or rate <= 0:
        raise BadRow(f"recording sampling_rate {rate!r} is not a rate in Hz")
    sources = [dict(s) for s in rec.get("sources") or [] if isinstance(s, Mapping)]
    for s in sources:
        if s.get("type") == "file" and isinstance(s.get("source"), str):
            s["source"] = os.path.normpath(os.path.join(workdir, os.path.expanduser(s["source"])))
    recording = json.dumps({**rec, "sources": sources}, sort_keys=True)
    channel = cut.get("channel")
    duration = cut.get("duration")
    return LhotseAudio(
        recording,
        tuple(channel) if isinstance(channel, list) else channel,
        float(cut.get("start", 0.0)),
        None if duration is None else float(duration),
        rate,
        transforms,
    )


def transform_names(transforms: Any) -> str:
    """The transforms as a person names them: ``speed 1.1, volume 2.0``."""
    out = []
    for t in transforms if isinstance(transforms, list) else [transforms]:
        name = str(t.get("name", "?")).lower() if isinstance(t, Mapping) else "?"
        kwargs = t.get("kwargs", {}) if isinstance(t, Mapping) else {}
        out.append(" ".join([name, *(str(v) for v in kwargs.values())]))
    return ", ".join(out)


def lhotse_wav(audio: LhotseAudio) -> io.BytesIO:
    """The cut's audio as lhotse loads it, as float32 WAV bytes in memory (lossless): the
    recipe's source decodes it as any file (mix, resample, crop, normalise)."""
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, audio.load().T, audio.rate, format="WAV", subtype="FLOAT")
    out.seek(0)
    return out
