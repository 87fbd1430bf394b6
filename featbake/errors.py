"""featbake's one exception hierarchy.

Every error a user can cause or fix is a :class:`FeatbakeError` whose message says what happened and
what to do. The CLI prints the message as one red line and exits with the class's ``exit_code``
(documented in ``featbake --help`` and the README); the library never prints.

Exit codes:
    0  success
    1  unexpected internal error (a bug: please report it, with ``FEATBAKE_DEBUG=1`` output)
    2  bad usage or option (:class:`ConfigError`); the ranks of a torchrun build given another
       encoder, recipe or data (:class:`RanksDisagree`)
    3  some inputs failed to decode or encode; the rest were stored (:class:`BuildIncomplete`)
    4  the encoder could not be loaded or refused to run (:class:`EncoderLoadError`)
    5  the store or catalog could not be read or written (:class:`StoreError`)
    6  stored data failed its checksum or header check (:class:`StoreCorrupt`)
    7  a feature is not in the store and live encoding was turned off (:class:`CacheMiss`)
    8  an input file could not be read or decoded (:class:`SourceError`); the inputs changed
       between the scans of a torchrun build's ranks (:class:`RanksDisagree`)
    9  the build process ended abruptly, e.g. ``os._exit()`` in an encoder
       (:class:`BuildProcessDied`)
    130 interrupted (Ctrl-C); everything sealed before the interrupt is kept
    143 stopped by SIGTERM (:class:`Terminated`); everything sealed before it is kept
"""

from __future__ import annotations

from collections.abc import Iterable


class FeatbakeError(Exception):
    """Base of every error featbake raises on purpose."""

    exit_code = 1


class ConfigError(FeatbakeError, ValueError):
    """An option or argument is invalid; the message names it and a valid example."""

    exit_code = 2


class BuildIncomplete(FeatbakeError):
    """A build finished, but some inputs failed; everything else was stored."""

    exit_code = 3


class EncoderLoadError(FeatbakeError):
    """The encoder could not be loaded, or was refused (e.g. an untrusted pickle)."""

    exit_code = 4


class EncodeError(FeatbakeError):
    """The encoder raised on an input, or returned something featbake cannot store."""

    exit_code = 4


class StoreError(FeatbakeError):
    """The store directory or its catalog could not be read or written."""

    exit_code = 5


class AwaitingMerge(StoreError):
    """The store holds only a build in parts whose merge has not run yet: no catalog, so no
    root is published. Commands that only report (``stats``, ``roots``) say what is pending
    instead of failing; those that change the store say to merge first."""


class StoreCorrupt(StoreError):
    """A shard's header or a tensor's checksum does not match what was written."""

    exit_code = 6


class ShardDamaged(StoreCorrupt):
    """A shard's header or bytes fail their checks; ``why`` says what failed without where or
    what to do, so that the reader of a shard kept elsewhere (a bucket's object, read by
    ranges) can say its own place and fix (``verify --repair`` is a directory's)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class CacheMiss(FeatbakeError, KeyError):
    """A feature is not in the store and the caller asked not to encode it live."""

    exit_code = 7

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "cache miss"


class SourceError(FeatbakeError):
    """An input file is missing, unreadable, empty or cannot be decoded."""

    exit_code = 8


class ColumnMissing(SourceError):
    """A manifest has rows and none holds the column named; ``columns``: those its first rows
    hold (where a reader may look for the column a build named)."""

    def __init__(self, message: str, columns: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.columns = columns


class Terminated(BaseException):
    """SIGTERM stopped the command (torchrun stopping the other ranks, SLURM, Kubernetes,
    docker); like Ctrl-C, everything sealed before it is kept and a rerun continues.

    A ``BaseException``, as ``KeyboardInterrupt`` is, not a :class:`FeatbakeError`: the code
    that handles featbake's or a library's errors (an export reading a root's data, a decoder's
    callback) must never take a stop for one of them. Before, an export went on and exited 0
    with false warnings, and ``verify`` swallowed it."""

    exit_code = 143


class ShardMissing(StoreError):
    """A shard the catalog names is gone (gc removed it, or it was deleted by hand).

    Readers re-resolve the key through the catalog once before giving up.
    """


class BuildProcessDied(FeatbakeError):
    """The build's process ended without featbake's own exit (``os._exit()``, a signal, OOM).

    Reported by the CLI's supervising process (see ``featbake/cli/supervise.py``); everything
    sealed before is kept.
    """

    exit_code = 9


class RanksDisagree(FeatbakeError):
    """The ranks of one torchrun launch do not see the same build: one was given another
    encoder, recipe or data (exit 2, as a :class:`ConfigError`), or the inputs changed between
    the ranks' scans (``data_changed``: exit 8, as a :class:`SourceError`).

    Every rank raises it with the same message, which names the ranks itself: the CLI prints
    it as it is, without the line that names the failing rank (no one rank failed).
    """

    exit_code = ConfigError.exit_code

    def __init__(self, message: str, *, data_changed: bool = False) -> None:
        super().__init__(message)
        self.data_changed = data_changed
        if data_changed:
            self.exit_code = SourceError.exit_code


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its class's name if it has none): how a library's
    error is quoted inside a featbake message, which stays one line."""
    text = str(e).strip().splitlines()
    return text[0].strip() if text else type(e).__name__


def brief(e: BaseException, limit: int = 500) -> str:
    r"""``e``'s message on one line, cut after ``limit`` characters (its class's name if it has
    none): for a library's error whose detail is on its later lines but may run to thousands
    of characters (transformers' list of every config class ``AutoModel`` knows).

    Example:
        >>> brief(ValueError("bad shape:\n  expected 3\n  got 4")), brief(ValueError("x" * 9), 4)
        ('bad shape: expected 3 got 4', 'xxxx...')
    """
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def last_line(e: BaseException) -> str:
    """The last line of ``e``'s message (its class's name if it has none): for errors whose
    last line holds the cause (a decoder's, after its own context lines)."""
    text = str(e).strip().splitlines()
    return text[-1].strip() if text else type(e).__name__


def first_few(named: Iterable[str], count: int) -> str:
    """Up to five of ``count`` things a message names (``named``: the first five), and how
    many more there are: a message stays one line however many there are.

    Example:
        >>> first_few(["a", "b", "c", "d", "e"], 7)
        'a; b; c; d; e (and 2 more)'
    """
    shown = "; ".join(named)
    return f"{shown} (and {count - 5} more)" if count > 5 else shown
