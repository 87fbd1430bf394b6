"""Which part of a build this process does: its rank, and a partition of the inputs by bytes.

Pure: no I/O, no torch. Everything is a function of ``--shard I/N`` or of the environment a
launcher sets (read from a mapping the caller passes, ``os.environ`` in practice):

- torchrun / torch.distributed.elastic: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``;
- a SLURM job array (``sbatch --array``): ``SLURM_ARRAY_TASK_ID``, ``SLURM_ARRAY_TASK_COUNT``,
  ``SLURM_ARRAY_TASK_MIN`` and ``SLURM_ARRAY_TASK_STEP`` (task ids need not start at 0);
- SLURM tasks (``srun -n N``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``.

The partition is what fairseq's and ESPnet's dump scripts do by hand (sorted inputs split into N
parts, each job writing its own output), balanced by bytes rather than by count, and unlike
``DistributedSampler`` it never pads by repeating inputs: every input is in exactly one part.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from featbake.errors import ConfigError, RanksDisagree

#: The most parts a build is split into (fragment names hold the rank in five digits).
MAX_PARTS = 99_999


class RankSource(StrEnum):
    """Where a process learnt its rank."""

    SINGLE = "single process"
    FLAG = "--shard"
    TORCHRUN = "torchrun"
    SLURM_ARRAY = "SLURM array"
    SLURM_TASKS = "SLURM tasks"


@dataclass(frozen=True)
class RankSpec:
    """This process's part of a build: ``rank`` of ``world`` (0-based), and its local rank."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    source: RankSource = RankSource.SINGLE

    def __post_init__(self) -> None:
        if self.world > MAX_PARTS:
            raise ConfigError(
                f"{self.world:,} parts (from {self.source.value}) is more than featbake splits a "
                f"build into (at most {MAX_PARTS:,}): every part must run and finish before "
                "`featbake merge` folds them in; use one part per process you will start"
            )
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ConfigError(
                f"rank {self.rank} of {self.world} (from {self.source.value}) is not a valid part: "
                "need 0 <= rank < world, e.g. --shard 0/4 ... --shard 3/4"
            )

    @property
    def sharded(self) -> bool:
        """True when this process does one part of several (it writes fragments, not rows)."""
        return self.world > 1

    @property
    def launched_together(self) -> bool:
        """True when all ranks run at once under one launcher that can hold a barrier."""
        return self.sharded and self.source is RankSource.TORCHRUN

    def describe(self) -> str:
        """``part 2 of 4 (torchrun)``: for messages."""
        return f"part {self.rank + 1} of {self.world} ({self.source.value})"


def parse_shard(text: str) -> RankSpec:
    """``--shard I/N`` (``I`` 0-based) as a :class:`RankSpec`.

    Raises:
        ConfigError: not of the form ``I/N`` with ``0 <= I < N``.

    Example:
        >>> parse_shard("1/4").rank, parse_shard("1/4").world
        (1, 4)
    """
    head, sep, tail = text.strip().partition("/")
    if not sep or not _ascii_digits(head) or not _ascii_digits(tail):
        raise ConfigError(
            f"--shard {text!r}: expected I/N with I counted from 0, e.g. --shard 0/4 ... 3/4"
        )
    return RankSpec(int(head), int(tail), 0, RankSource.FLAG)


def _ascii_digits(text: str) -> bool:
    """``0``-``9`` only: ``str.isdigit`` also takes digits such as ``"²"`` that int() refuses."""
    return text.isascii() and text.isdigit()


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise ConfigError(f"${name} is not set, but the launcher's other variables are")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name}={value!r} is not an integer") from None


def rank_from_env(env: Mapping[str, str]) -> RankSpec:
    """The rank a launcher gave this process: torchrun, then a SLURM array, then SLURM tasks.

    torchrun wins over SLURM (torchrun started inside a SLURM job sets both); an array task is
    one part (its ``SLURM_PROCID`` is 0 in a one-task job). Without any of them: one process.

    Example:
        >>> rank_from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}).describe()
        'part 4 of 8 (torchrun)'
        >>> rank_from_env({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "1",
        ...                "SLURM_ARRAY_TASK_COUNT": "8"}).rank
        6
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return RankSpec(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK", 0),
            RankSource.TORCHRUN,
        )
    if "SLURM_ARRAY_TASK_ID" in env and "SLURM_ARRAY_TASK_COUNT" in env:
        task = _int(env, "SLURM_ARRAY_TASK_ID")
        first = _int(env, "SLURM_ARRAY_TASK_MIN", 0)
        step = max(1, _int(env, "SLURM_ARRAY_TASK_STEP", 1))
        if (task - first) % step:
            raise ConfigError(
                f"SLURM array task {task} is not on the array's grid (min {first}, step {step})"
            )
        return RankSpec(
            (task - first) // step, _int(env, "SLURM_ARRAY_TASK_COUNT"), 0, RankSource.SLURM_ARRAY
        )
    if "SLURM_PROCID" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        return RankSpec(
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID", 0),
            RankSource.SLURM_TASKS,
        )
    return RankSpec()


def resolve_rank(shard: str | None, env: Mapping[str, str]) -> RankSpec:
    """``--shard I/N`` when given, else what the environment says."""
    return parse_shard(shard) if shard else rank_from_env(env)


def partition(sizes: Sequence[int], world: int) -> list[list[int]]:
    """Split inputs ``0..len(sizes)-1`` into ``world`` parts of about equal bytes.

    Largest first, each to the part with the fewest bytes so far (ties: fewer inputs, then the
    lower rank), so no part exceeds the mean by more than one input. Deterministic: every rank
    computes the same partition from the same sorted listing. Each part is in input order.
    No padding and no duplicates: each index is in exactly one part; a part may be empty.

    Example:
        >>> partition([5, 1, 1, 1, 1, 1], 2)
        [[0], [1, 2, 3, 4, 5]]
    """
    if world < 1:
        raise ConfigError(f"cannot split inputs into {world} parts")
    parts: list[list[int]] = [[] for _ in range(world)]
    for r, part in enumerate(_busy_parts(sizes, world)):
        parts[r] = part
    return parts


def _busy_parts(sizes: Sequence[int], world: int) -> list[list[int]]:
    """:func:`partition`'s first ``min(world, len(sizes))`` parts: the others are empty.

    While some part is empty the greedy rule picks the empty part of lowest rank (load 0 and
    count 0 sort before any part that holds an input), so ranks past ``len(sizes)`` never get
    one; leaving them out keeps the work O(inputs) however large ``world`` is.
    """
    world = min(world, len(sizes))
    heap = [(0, 0, r) for r in range(world)]
    parts: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, count, r = heapq.heappop(heap)
        parts[r].append(i)
        heapq.heappush(heap, (load + max(0, sizes[i]), count + 1, r))
    for part in parts:
        part.sort()
    return parts


def my_part(sizes: Sequence[int], spec: RankSpec) -> list[int]:
    """The input indices that rank ``spec.rank`` does (all of them for a single process)."""
    if not spec.sharded:
        return list(range(len(sizes)))
    busy = _busy_parts(sizes, spec.world)  # O(inputs), not O(world)
    return busy[spec.rank] if spec.rank < len(busy) else []


def device_for_rank(device: str, spec: RankSpec) -> str:
    """``cuda`` means ``cuda:LOCAL_RANK`` under a launcher that starts one process per GPU.

    An explicit ``cuda:N`` is kept; a SLURM array task sees only its own GPUs, so ``cuda`` stays.

    Example:
        >>> device_for_rank("cuda", RankSpec(5, 8, 1, RankSource.TORCHRUN))
        'cuda:1'
    """
    per_gpu = spec.source in (RankSource.TORCHRUN, RankSource.SLURM_TASKS)
    if device == "cuda" and spec.sharded and per_gpu:
        return f"cuda:{spec.local_rank}"
    return device


def owned_by_lower_ranks(rank: int, keys_by_rank: Sequence[Sequence[str]]) -> set[str]:
    """The keys of ``rank`` that a lower rank also has to encode: that rank encodes them.

    Content dedup across ranks: identical files that fall to two ranks (the partition splits
    paths, not contents) are encoded once, by the lowest rank that holds their key; the others
    list the item in their manifest slice and `merge` points it at that rank's feature.

    Example:
        >>> sorted(owned_by_lower_ranks(1, [["a", "b"], ["b", "c"]]))
        ['b']
    """
    lower: set[str] = set()
    for other in keys_by_rank[:rank]:
        lower.update(other)
    return lower.intersection(keys_by_rank[rank])


# -- ranks that disagree ---------------------------------------------------------------------
# Every rank of a torchrun build computes the build's id from the root, the encoder's and the
# recipe's fingerprints and the inputs' listing (store/fragments.py, ``build_id``). Ranks that
# see another encoder (a node with another version of the module), another recipe (one rank
# launched with another option) or another listing (a file landing between their scans) each
# form a build of their own that never completes: before, the job exited 0, rank 0 said
# "merged", and no root was published. The ranks now compare what makes the id before any of
# them encodes (:func:`featbake.bake.pipeline.check_ranks_agree`), and all stop if it differs.


@dataclass(frozen=True)
class BuildView:
    """What one rank takes its build to be: what the build's id is made of, and enough beside
    it (the encoder as named, the recipe's fields, the data) to say what differs."""

    root: str
    data: str
    column: str | None
    encoder: str
    encoder_fp: str
    recipe: tuple[tuple[str, str], ...]  # the recipe's fields, as text
    recipe_fp: str
    inputs: int
    listing: str  # :func:`listing_digest` of the (path, bytes) of every input


def listing_digest(listing: Sequence[tuple[str, int]]) -> str:
    """A digest of a build's listing, (relative path, bytes) of every input in order: two ranks
    with the same digest computed the same build id from it."""
    text = json.dumps([list(x) for x in listing], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_views_agree(
    views: Sequence[BuildView], listings: Sequence[Sequence[tuple[str, int]]] = ()
) -> None:
    """Raise unless every rank's view equals rank 0's (``views[r]``: rank r's). ``listings``:
    every rank's listing, when the listings differ, to name the inputs that differ.

    Raises:
        RanksDisagree: the first rank that differs, and what differs: its encoder, its recipe,
            its root (data, encoder as named, column) or its inputs (``data_changed``).

    Example:
        >>> v = BuildView("r-1", "/d", None, "m:make", "e0", (("dtype", "float32"),), "p", 2, "l")
        >>> check_views_agree([v, v])
    """
    first = views[0]
    for rank, view in enumerate(views):
        if view.encoder_fp != first.encoder_fp:
            raise RanksDisagree(_encoders_differ(rank, view, first))
        if view.recipe_fp != first.recipe_fp:
            raise RanksDisagree(_recipes_differ(rank, view, first))
        if view.root != first.root:
            raise RanksDisagree(_roots_differ(rank, view, first))
        if view.listing != first.listing:
            theirs, mine = (listings[rank], listings[0]) if listings else ((), ())
            said = _inputs_differ(rank, view, first, inputs_only_on(rank, theirs, mine))
            raise RanksDisagree(said, data_changed=True)


def _encoders_differ(rank: int, view: BuildView, first: BuildView) -> str:
    """Rank ``rank``'s encoder is another than rank 0's: say so, with their fingerprints."""
    named = "" if view.encoder == first.encoder else f"{first.encoder} "
    return (
        f"rank {rank}'s encoder differs from rank 0's: {view.encoder} is "
        f"{view.encoder_fp[:12]} on rank {rank} and {named}{first.encoder_fp[:12]} on rank 0 "
        "(another file, weights or version of its code on that rank's node); give every rank "
        "the same encoder, then rerun (nothing was encoded)"
    )


def _recipes_differ(rank: int, view: BuildView, first: BuildView) -> str:
    """Rank ``rank``'s recipe is another than rank 0's: name the fields that differ."""
    mine, theirs = dict(first.recipe), dict(view.recipe)
    fields = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    said = ", ".join(
        f"{k} {theirs.get(k, '(none)')} on rank {rank}, {mine.get(k, '(none)')} on rank 0"
        for k in fields
    )
    return (
        f"rank {rank}'s recipe differs from rank 0's: {said or 'its fingerprint'}; launch "
        "every rank with the same options, then rerun (nothing was encoded)"
    )


def _roots_differ(rank: int, view: BuildView, first: BuildView) -> str:
    """Rank ``rank`` builds another root than rank 0 (other data, encoder name or column)."""
    named = [
        (what, theirs, mine)
        for what, theirs, mine in (
            ("data", view.data, first.data),
            ("encoder", view.encoder, first.encoder),
            ("column", view.column, first.column),
        )
        if theirs != mine
    ]
    said = ", ".join(f"{w} {t} on rank {rank}, {m} on rank 0" for w, t, m in named)
    return (
        f"rank {rank} builds another root than rank 0 ({said or f'{view.root}, {first.root}'}); "
        "give every rank the same --data, --encoder and --column, then rerun (nothing was "
        "encoded)"
    )


def _inputs_differ(rank: int, view: BuildView, first: BuildView, only: str) -> str:
    """Rank ``rank`` listed other inputs than rank 0: the data changed as the build started."""
    counts = f"{view.inputs:,} inputs on rank {rank}, {first.inputs:,} on rank 0"
    return (
        f"rank {rank} lists other inputs than rank 0 ({counts}{'; ' + only if only else ''}): "
        "the data changed while the build started (an input added, removed or rewritten "
        "between the ranks' scans), or the ranks do not see the same data; rerun once the "
        "data is settled, every rank reading the same data (nothing was encoded)"
    )


def inputs_only_on(
    rank: int, theirs: Sequence[tuple[str, int]], mine: Sequence[tuple[str, int]], most: int = 3
) -> str:
    """The inputs that rank ``rank``'s listing (``theirs``) and rank 0's (``mine``) do not
    share, at most ``most`` of each kind named; "" where none differ (or none were given).

    Example:
        >>> inputs_only_on(1, [("a", 1), ("b", 2)], [("a", 1)])
        'only on rank 1: b'
        >>> inputs_only_on(1, [("a", 3)], [("a", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1)])
        'only on rank 0: c, d, e and 1 more; another size on rank 1: a'
    """
    there, here = dict(theirs), dict(mine)
    resized = {p for p in there.keys() & here.keys() if there[p] != here[p]}
    kinds = (
        (f"only on rank {rank}", there.keys() - here.keys()),
        ("only on rank 0", here.keys() - there.keys()),
        (f"another size on rank {rank}", resized),
    )
    return "; ".join(f"{what}: {_first(sorted(paths), most)}" for what, paths in kinds if paths)


def _first(paths: list[str], most: int) -> str:
    """``a, b, c and 4 more``: the first ``most`` of ``paths``, and how many are left out."""
    more = f" and {len(paths) - most:,} more" if len(paths) > most else ""
    return ", ".join(paths[:most]) + more
