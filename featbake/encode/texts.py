"""Texts named by a manifest: ``--source text --data captions.jsonl --column caption``.

For ``--source text`` a manifest's input column holds each item's text itself, not a path to it
(:class:`TextRows`, chosen by :func:`featbake.encode.inputs.inputs_at` when the recipe's source
is ``text``). Everything else is a manifest's (:class:`featbake.encode.manifests.RowInputs`):
items are the rows in the manifest's order, each named by its ``id`` column (default: its line
number), every other column carried, a repeated id refused.

**Keys.** A text's digest is the SHA-256 of its UTF-8 bytes, so the same text in a ``.txt``
file (without a trailing newline) has the same key. The texts are held from the parse: what is
tokenised is exactly what was hashed, whatever happens to the manifest meanwhile.

**Bad rows** are skipped, one line each naming the manifest's line: malformed JSON or CSV, a
table row of another field count than the header's, no such column, a cell that is not text (a
number, a list) or is empty, a cell that is not valid UTF-8. The manifest is read as
:func:`featbake.encode.manifests.manifest_records` reads it (a byte-order mark dropped, a TSV
unquoted), and a column no row holds is one error before any work, not a bad row per row.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, BinaryIO, ClassVar

import torch

from featbake.encode.fingerprints import Digester, HeldBytes, digest_here
from featbake.encode.manifests import (
    OWN_COLUMNS,
    BadRow,
    ColumnsSeen,
    Item,
    Parsed,
    RowInputs,
    manifest_records,
    replace_rows,
)
from featbake.encode.sources import SkippedInput, Source
from featbake.errors import SourceError
from featbake.keys import sha256_hex
from featbake.progress import Progress
from featbake.store.hash_cache import FileStat, HashCache

#: The input column when ``--column`` is not given.
TEXT_COLUMN = "text"


def text_cell(fields: Mapping[str, Any], column: str) -> str:
    """The text a row's ``column`` holds.

    Raises:
        BadRow: no such column, not text, empty, or not valid UTF-8 (a byte the manifest's
            decoding kept as a lone surrogate).
    """
    if column not in fields:
        given = ", ".join(str(k) for k in fields) or "none"
        raise BadRow(f"no {column!r} column (columns: {given}); name the text with --column")
    value = fields[column]
    if not isinstance(value, str):
        raise BadRow(f"column {column!r} holds {type(value).__name__} {value!r}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start]
        raw = ord(bad) - 0xDC00 if 0xDC80 <= ord(bad) <= 0xDCFF else None
        byte = f" (byte 0x{raw:02x})" if raw is not None else ""
        raise BadRow(f"column {column!r} is not UTF-8 text{byte}; convert the manifest") from None
    if not value.strip():
        raise BadRow(f"column {column!r} is empty")
    return value


class TextRows(RowInputs):
    """A manifest whose column holds each item's text (see the module's docstring)."""

    hashed_anywhere: ClassVar[bool] = False  # a row's text is its bytes: no file to read

    def __init__(self, data: str | os.PathLike[str], column: str | None = None) -> None:
        super().__init__(data, column)
        self.texts: dict[str, str] = {}  # Item.where -> its text (filled by the scan)
        self.manifest_stat: FileStat | None = None

    def parse(self) -> Parsed:
        column = self.column or TEXT_COLUMN
        name = os.path.basename(self.origin)
        parsed = Parsed()
        self.texts.clear()
        seen = ColumnsSeen(column)
        for line, fields in self._text_records():
            where = f"{self.origin}:{line}"
            try:
                if isinstance(fields, BadRow):
                    raise fields
                seen.note(fields)
                text = text_cell(fields, column)
            except BadRow as e:
                parsed.skipped.append(SkippedInput(f"{name}:{line}", str(e)))
                continue
            ident = fields.get("id")
            ident = str(line) if ident in (None, "") else str(ident)
            skip = {column, *OWN_COLUMNS}
            carried = {k: v for k, v in fields.items() if k not in skip}
            parsed.items.append((ident, Item(self.origin, None, where, carried)))
            self.texts[where] = text
        seen.check(self.origin, "name the text with --column")
        return parsed

    def _text_records(self) -> Iterator[tuple[int, Mapping[str, Any] | BadRow]]:
        """(line number, fields) per row; bytes that are not UTF-8 are kept as lone surrogates,
        so that only the rows holding them are bad (:func:`text_cell`), not the manifest.

        Raises:
            SourceError: the manifest does not exist or cannot be read.
        """
        try:
            self.manifest_stat = FileStat.of(self.origin)
        except FileNotFoundError:
            raise SourceError(f"manifest {self.origin} does not exist") from None
        except OSError as e:
            raise SourceError(f"manifest {self.origin} cannot be read ({e})") from None
        return manifest_records(self.origin, errors="surrogateescape")

    def size(self, rel: str) -> int:
        item = self.items.get(rel)
        return len(self.texts.get(item.where, "").encode("utf-8")) if item is not None else 0

    def hash(
        self,
        catalog: HashCache,
        paths: Sequence[str],
        progress: Callable[[Progress], None] | None = None,
        stats: dict[str, FileStat] | None = None,
        held: HeldBytes | None = None,
        digester: Digester = digest_here,
    ) -> tuple[dict[str, str], dict[str, str]]:
        """Each row's digest: the SHA-256 of its text's UTF-8 bytes (no file is read).

        ``stats`` gets the manifest's stat for each row (the texts were read from it);
        ``held`` keeps nothing: the texts are held since the parse; ``digester`` reads
        nothing either (the texts are hashed here: :attr:`hashed_anywhere` is False).
        """
        stats = {} if stats is None else stats
        digests: dict[str, str] = {}
        bad: dict[str, str] = {}
        for path in paths:
            text = self.texts.get(path)
            if text is None:
                bad[path] = f"{path}: not a row of the manifest (scan it first)"
                continue
            digests[path] = sha256_hex(text.encode("utf-8"))
            stats[path] = self.manifest_stat or FileStat(-1, -1, -1, -1)
        return digests, bad

    def carried(self, path: str) -> str | None:
        """Row ``path``'s text: what a worker encodes."""
        return self.texts.get(path)

    def carry(self, rows: Mapping[str, object]) -> dict[str, str]:
        """Take one task's rows' texts (the table the source made from these inputs reads),
        in place of the last task's."""
        return replace_rows(self.texts, rows, str)

    def source(self, inner: Source) -> Source:
        return TextCellSource(inner, self.texts)


class TextCellSource:
    """The recipe's text source over a manifest's texts: a row's text is handed to it as the
    UTF-8 bytes that were hashed.

    Args:
        inner: the recipe's source (:class:`featbake.encode.sources.TextSource`).
        texts: row path (``captions.jsonl:12``) -> its text (the inputs' own table).
    """

    def __init__(self, inner: Source, texts: Mapping[str, str]) -> None:
        self.inner = inner
        self.texts = texts
        self.kind = inner.kind
        self.extensions = inner.extensions

    def load(self, path: str | os.PathLike[str], data: BinaryIO | None = None) -> torch.Tensor:
        """Tokenise row ``path``'s text.

        Raises:
            SourceError: the row is unknown, or its text cannot be tokenised.
        """
        text = self.texts.get(os.fspath(path))
        if text is None:
            raise SourceError(f"{path}: not a row of the manifest; rerun")
        return self.inner.load(path, io.BytesIO(text.encode("utf-8")))

    def load_unchanged(self, path: str, stat: FileStat | None) -> torch.Tensor:
        """Tokenise row ``path``'s text: the one held since it was hashed, so it cannot have
        changed in between."""
        return self.load(path)
