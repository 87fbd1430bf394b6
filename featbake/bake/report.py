"""BuildReport: what a build did, for the CLI's summary and --json."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from featbake.errors import EncodeError, FeatbakeError

#: Numbers in a failure's reason (shapes, sizes, indices) differ from input to input.
_NUMBERS = re.compile(r"\d+")


class FailureCause(StrEnum):
    """Whose a failed input's failure is: what the summary points at when every input failed
    alike (a build's advice follows it, not a blanket sentence)."""

    #: The data: a row that cannot be an item (a manifest's bad row, a multi-file recording, a
    #: table cell without bytes), a file missing or unreadable, an input that does not decode
    #: as the source. Raised as :class:`~featbake.errors.SourceError`.
    DATA = "data"
    #: The encoder (or the options it is run with): it raised on the input, or returned what
    #: cannot be stored. Raised as :class:`~featbake.errors.EncodeError`.
    ENCODER = "encoder"

    @classmethod
    def of(cls, error: FeatbakeError) -> FailureCause:
        """The cause of a failure raised (with ``--strict``) as ``error``."""
        return cls.ENCODER if isinstance(error, EncodeError) else cls.DATA


@dataclass
class BuildReport:
    """What a build did. ``failed`` lists (relative path, reason) for each skipped input, and
    ``causes`` each one's :class:`FailureCause`, in the same order (:meth:`fail` adds both)."""

    root: str
    data: str
    encoder: str
    encoder_fp: str
    recipe_fp: str
    files: int = 0
    encoded: int = 0
    reused: int = 0
    derived: int = 0  # copied from a whole-output build's stored part (--output; bake/derive.py)
    converted: int = 0  # cast or quantised from stored float32 features (--dtype; bake/derive.py)
    duplicates: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    causes: list[FailureCause] = field(default_factory=list)
    bytes_written: int = 0
    shards_written: int = 0
    seconds: float = 0.0
    batching: str = ""  # the mode that ran: padded or exact (featbake.bake.batching)
    batching_note: str = ""  # why that mode, in one line
    part: str = ""  # "part 2 of 4 (torchrun)" when this process did one part of a build
    fragment: str | None = None  # the part's sealed `done` fragment, for `featbake merge`
    merged: bool = False  # every part's fragments were merged when this process returned
    merged_by: str = ""  # who merged them, where another process did ("rank 0" under torchrun)
    fidelity: dict[str, Any] | None = None  # int8/fp8: featbake.quantize.Fidelity, measured
    fidelity_warning: str = ""  # the measured error is over --max-error, in one line
    notes: list[str] = field(default_factory=list)  # the scan's, one line each: no failures

    @property
    def ok(self) -> bool:
        return not self.failed

    def fail(self, rel: str, reason: str, cause: FailureCause) -> None:
        """Record a failed input, its reason and whose failure it is."""
        self.failed.append((rel, reason))
        self.causes.append(cause)

    def common_cause(self) -> FailureCause | None:
        """The cause every failure has (None: none failed, they differ, or one's is not
        recorded)."""
        kinds = set(self.causes)
        if len(self.causes) != len(self.failed) or len(kinds) != 1:
            return None
        return kinds.pop()

    def common_failure(self) -> str | None:
        """The one reason every input failed for, when at least two all failed alike.

        Inputs failing one by one are the inputs' fault; all of them failing the same way
        (a mono encoder given ``--no-mono``, a wrong ``--output``) is the encoder's or the
        options'. "Alike" ignores the file's own name and every number (shapes, lengths).
        """
        if len(self.failed) < 2 or len(self.failed) < self.files:
            return None
        kinds = {_failure_kind(rel, reason) for rel, reason in self.failed}
        if len(kinds) != 1:
            return None
        rel, reason = self.failed[0]
        return reason.removeprefix(f"{rel}: ")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict of the report (``featbake build --json``)."""
        d = asdict(self)
        cause = dict(enumerate(str(c) for c in self.causes))  # as recorded: see `fail`
        d["failed"] = [
            {"path": p, "reason": r, "cause": cause.get(i)} for i, (p, r) in enumerate(self.failed)
        ]
        del d["causes"]
        return d


def _failure_kind(rel: str, reason: str) -> str:
    """``reason`` without the input's name and with every number made alike."""
    return _NUMBERS.sub("N", reason.replace(rel, "INPUT"))
