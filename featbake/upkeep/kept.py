"""Who keeps features from ``gc --max-bytes``, and what a user does about it.

Eviction passes over the keys builds not merged yet name (``kept_for_builds`` in ``gc.py``):
live claims of build parts and datasets still running, sealed fragments of builds in parts,
and ``serve`` fragments of datasets on a shared filesystem (a root in waiting: the merge
publishes it). They count toward the budget, so a run may stop short of it; gc then says by how
much and who holds what (:class:`Shortfall`), because a part never run, or fragments nobody
merges, keep their features for good and nothing else would tell.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from featbake.errors import StoreCorrupt
from featbake.store.claims import ClaimState, claim_state, claims_now, pid_alive, read_claims
from featbake.store.claims import this_host as claims_host
from featbake.store.fragments import (
    FragmentKind,
    FragmentName,
    fragment_named_keys,
    read_fragment,
    sealed_fragments,
)
from featbake.store.layout import Layout
from featbake.units import format_bytes


class KeptBy(StrEnum):
    """What keeps keys from eviction."""

    RUNNING = "running"  # a live claim: a build part or a dataset still running
    PARTS = "parts"  # a build in parts whose sealed fragments wait for a merge
    SERVING = "serving"  # a dataset's root in ``serve`` fragments, waiting for a merge


#: The merge command a holder's "what to do" names where no store is given (``{merge}`` in
#: :attr:`Keeper.todo`; the CLI names its store's ``--cache``).
MERGE = "featbake merge"


@dataclass(frozen=True)
class Keeper:
    """One holder of kept keys: ``who`` it is, in words, and ``todo``, what frees them."""

    kind: KeptBy
    who: str
    todo: str
    keys: frozenset[str]

    def line(self, nbytes: int, merge: str = MERGE) -> str:
        """``a running build (pid 7 on host h) holds 2 MiB; run gc again when it finishes``;
        ``merge`` is the merge command to name (with the store's ``--cache``)."""
        return f"{self.who} holds {format_bytes(nbytes)}; {self.todo.format(merge=merge)}"

    def to_json(self, nbytes: int) -> dict[str, Any]:
        """``gc --json``'s ``kept_for`` entry: kind, who, bytes, features, todo."""
        return {"kind": str(self.kind), "who": self.who, "bytes": nbytes,
                "features": len(self.keys), "todo": self.todo.format(merge=MERGE)}  # fmt: skip


@dataclass(frozen=True)
class Shortfall:
    """Why a ``--max-bytes`` run stays over its budget: ``over_bytes`` past it, of which
    ``kept_bytes`` are features builds not merged yet name, and who holds them (bytes each; a
    key two hold counts for both)."""

    budget: int
    over_bytes: int
    kept_bytes: int
    keepers: tuple[tuple[Keeper, int], ...]
    #: where shards are never rewritten (a bucket store): the bytes beside the kept features in
    #: their shards (other features, dead rows), which stay with them
    beside_bytes: int = 0

    def line(self, merge: str = MERGE) -> str:
        """One line: the budget left exceeded, and each holder with what to do (``merge``: the
        merge command for this store, ``featbake merge --cache STORE``)."""
        held = "; ".join(k.line(n, merge) for k, n in self.keepers)
        held = held or "builds not merged yet hold them"
        beside = (
            f"; a bucket store never rewrites a shard, so the {format_bytes(self.beside_bytes)} "
            "beside them in their shards stays too"
            if self.beside_bytes
            else ""
        )
        return (
            f"gc stays {format_bytes(self.over_bytes)} over --max-bytes "
            f"{format_bytes(self.budget)}: {format_bytes(self.kept_bytes)} of features are kept "
            f"for builds and datasets not merged yet ({held}){beside}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "over_budget_bytes": self.over_bytes,
            "kept_for_builds_bytes": self.kept_bytes,
            "kept_beside_bytes": self.beside_bytes,
            "kept_for": [k.to_json(n) for k, n in self.keepers],
        }


def shortfall(
    layout: Layout, budget: int, left: Mapping[str, float], kept: frozenset[str]
) -> Shortfall | None:
    """What keeps a run over ``budget``: ``left`` is each key's cost on disk once the plan's
    evictions are done, ``kept`` the keys eviction passed over; None when it fits, or when
    nothing kept is the cause (every evictable key already went)."""
    total = sum(left.values())
    kept_bytes = sum(c for k, c in left.items() if k in kept)
    if total <= budget or kept_bytes <= 0:
        return None
    keepers = []
    for keeper in keepers_of(layout):
        nbytes = sum(c for k, c in left.items() if k in keeper.keys)
        if nbytes > 0:
            keepers.append((keeper, round(nbytes)))
    # Rounded, not cut: a bucket shard's bytes are shared among its keys as fractions, whose
    # sum may fall a hair short of the whole (int() then said 1 byte less than gc leaves, and
    # the run warned of bytes it did not foresee).
    return Shortfall(budget, round(total - budget), round(kept_bytes), tuple(keepers))


def keepers_of(layout: Layout) -> list[Keeper]:
    """Every holder of kept keys: live claims, builds in parts, datasets' ``serve`` roots."""
    return [*claim_keepers(layout), *fragment_keepers(layout)]


def claim_keepers(layout: Layout) -> list[Keeper]:
    """A keeper per live claim (stale ones keep nothing: gc removes them)."""
    now, here = claims_now(layout), claims_host()
    out = []
    for c in read_claims(layout, now):
        if claim_state(c.head, now, here, pid_alive) is not ClaimState.LIVE:
            continue
        host = c.head.host.split("/", 1)[0]
        out.append(
            Keeper(
                KeptBy.RUNNING,
                f"a running build (pid {c.head.pid} on host {host})",
                "run gc again when it finishes",
                c.keys,
            )
        )
    return out


def fragment_keepers(layout: Layout) -> list[Keeper]:
    """A keeper per build in parts with sealed fragments, and per root datasets published in
    ``serve`` fragments."""
    builds: dict[str, list[FragmentName]] = defaultdict(list)
    serving: dict[str, list[FragmentName]] = defaultdict(list)
    for name in sealed_fragments(layout):
        if name.kind is FragmentKind.SERVE:
            serving[root_of(layout, name)].append(name)
        else:
            builds[name.build_id].append(name)
    out = [parts_keeper(layout, names) for names in builds.values()]
    out += [
        Keeper(
            KeptBy.SERVING,
            f"root {root} in a dataset's {len(names)} serve fragments",
            "run `{merge}` to publish it",
            frozenset(fragment_named_keys(n.path for n in names)),
        )
        for root, names in serving.items()
    ]
    return out


def parts_keeper(layout: Layout, names: list[FragmentName]) -> Keeper:
    """The keeper of one build in parts: which parts sealed their ``done`` fragment, and what
    the rest need (run, then merge; or just the merge when all are done)."""
    world = names[0].world
    done = sorted({n.rank for n in names if n.kind is FragmentKind.DONE})
    missing = [r for r in range(world) if r not in done]
    who = f"root {root_of(layout, names[0])}'s build in parts ({len(done)} of {world} done)"
    if not missing:
        todo = "run `{merge}`"
    else:
        todo = (
            f"part {', '.join(f'{r}/{world}' for r in missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''} not done: if none is running, run it "
            f"(`featbake build ... --shard {missing[0]}/{world}`) or build the root again, "
            "then `{merge}`"
        )
    return Keeper(KeptBy.PARTS, who, todo, frozenset(fragment_named_keys(n.path for n in names)))


def root_of(layout: Layout, name: FragmentName) -> str:
    """The root a sealed fragment's build publishes (its file name where it cannot be read)."""
    try:
        return read_fragment(name.path, layout, with_entries=False).info.root
    except (StoreCorrupt, OSError):  # merged and removed since the listing, or unreadable
        return f"(fragment {name.path.name})"
