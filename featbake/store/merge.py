"""``featbake merge``: fold sealed catalog fragments (:mod:`featbake.store.fragments`) into the
catalog.

A build is merged once the ``done`` fragment of each of its N ranks is sealed (before that its
root manifest would be partial, and readers map dataset index -> key through it). Per build,
in this order:

1. the encoder row, then the whole root manifest (every rank's slice, by index) in one
   transaction, so gc never sees the build's features unreached;
2. each shard's rows (one short transaction per shard; first row wins, as in a build), less
   those void (:class:`Replacements`: keys a build stored again);
3. the hash-cache rows;
4. only then the fragment files are unlinked.

Then the builds not finished (a part killed, preempted, or still running): their shards'
rows only (:func:`fold_waiting`; their manifests wait for every rank), so a rerun in any shape
finds what they sealed, and gc keeps those rows while their fragments wait. A build whose root
was published again after its last fragment (a rerun of the same data, encoder and recipe in
another shape, or in one process) is retired: its fragments are unlinked. So is one whose root
the user names to ``abandon`` (``featbake merge --abandon ROOT``): a build some part of which
was killed for good (a Ray or torchrun build SIGKILLed and never rerun, an array task that will
not run) stays pending for ever otherwise, and gc keeps its shards; nothing here can tell such
a part from one still to start. Its shards' rows stay in the catalog, freed by gc once no root
names them.

Then the ``serve`` fragments of datasets on a shared filesystem or a bucket's tier, each on its
own, oldest first: its encoder, its root manifest (unless the catalog's root is newer), its
write-back shard's rows and its hash rows; then every last use they recorded (a feature's last
use only moves forward); then they are unlinked.

Every step is idempotent: rows are inserted with the fragment's own timestamps and ``INSERT OR
IGNORE``, so a merge killed anywhere leaves fragments that the next merge folds again to the
same catalog, and a second merge with nothing new changes nothing. It is safe while ranks still
run: it reads only sealed fragments and leaves builds with a rank missing alone (listed as
pending). Only this one process writes the catalog, which is what a shared filesystem needs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sqlite3
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

from featbake.errors import ConfigError, ShardMissing, StoreCorrupt
from featbake.store.catalog import Catalog, VoidRows
from featbake.store.fidelity import Measured, write_fidelity
from featbake.store.files import fsync_dir
from featbake.store.fragments import (
    BuildInfo,
    Fragment,
    FragmentKind,
    FragmentName,
    ManifestItem,
    Replacing,
    fragments_dir,
    read_fragment,
    replacing_of,
    sealed_fragments,
    serving_fragments,
)
from featbake.store.hash_cache import HashCacheRow
from featbake.store.layout import Layout
from featbake.store.locks import alone
from featbake.store.roots import read_undecodable, roots_named, write_undecodable


@dataclass(frozen=True)
class PendingBuild:
    """A build some of whose ranks have not sealed their ``done`` fragment yet."""

    build_id: str
    root: str
    world: int
    ranks_done: tuple[int, ...]
    fragments: int

    @property
    def complete(self) -> bool:
        """Whether every rank sealed its ``done`` fragment: only the merge is left."""
        return len(self.ranks_done) == self.world

    def describe(self) -> str:
        return (
            f"root {self.root}: {len(self.ranks_done)} of {self.world} ranks done "
            f"({self.fragments} fragments sealed, not merged yet)"
        )


@dataclass
class MergeReport:
    """What a merge folded in, and what it left waiting."""

    roots: list[str] = field(default_factory=list)
    fragments: int = 0
    serving_fragments: int = 0
    shards: int = 0
    new_features: int = 0
    missing_shards: list[str] = field(default_factory=list)
    pending: list[PendingBuild] = field(default_factory=list)
    #: fragments left unmerged because they cannot be read (``skip_damaged``): file names
    damaged: list[str] = field(default_factory=list)
    #: shards sealed by builds not finished (a part killed, or still running), in the catalog
    waiting_shards: int = 0
    #: roots whose unfinished build was retired: a later build of the root was published
    superseded: list[str] = field(default_factory=list)
    #: roots whose unfinished builds were retired because the user abandoned them
    abandoned: list[str] = field(default_factory=list)
    #: rows the catalog held, before this merge folded anything, that a build's replacement
    #: voids (:class:`Replacements`): a bucket publishes their drop even where nothing else
    #: changed
    void_rows: int = 0

    def to_json(self) -> dict:
        return {
            "roots": self.roots,
            "fragments": self.fragments,
            "serving_fragments": self.serving_fragments,
            "shards": self.shards,
            "new_features": self.new_features,
            "waiting_shards": self.waiting_shards,
            "superseded": self.superseded,
            "abandoned": self.abandoned,
            "void_rows": self.void_rows,
            "missing_shards": self.missing_shards,
            "pending": [p.__dict__ | {"ranks_done": list(p.ranks_done)} for p in self.pending],
        }


def _by_build(layout: Layout) -> dict[str, list[FragmentName]]:
    """Build fragments by build id (``serve`` fragments are merged on their own)."""
    builds: dict[str, list[FragmentName]] = {}
    for name in sealed_fragments(layout):
        if name.kind is not FragmentKind.SERVE:
            builds.setdefault(name.build_id, []).append(name)
    return builds


def _is_complete(names: list[FragmentName]) -> bool:
    world = names[0].world
    done = {n.rank for n in names if n.kind is FragmentKind.DONE and n.world == world}
    return done == set(range(world))


def pending_builds(layout: Layout) -> list[PendingBuild]:
    """Builds with sealed fragments that cannot be merged yet (``roots``/``stats`` show them)."""
    return unmerged_builds(layout, complete=False)


def unmerged_builds(layout: Layout, *, complete: bool = True) -> list[PendingBuild]:
    """Builds with sealed fragments (``verify`` notes them): every one, or (``complete``
    False) those some rank has not finished yet."""
    out = []
    for bid, names in sorted(_by_build(layout).items()):
        if _is_complete(names) and not complete:
            continue
        try:
            root = read_fragment(names[0].path, layout, with_entries=False).info.root
        except StoreCorrupt:
            root = f"(unreadable fragment {names[0].path.name})"
        done = sorted({n.rank for n in names if n.kind is FragmentKind.DONE})
        out.append(PendingBuild(bid, root, names[0].world, tuple(done), len(names)))
    return out


def merge(
    layout: Layout,
    *,
    between: Callable[[str], None] | None = None,
    skip_damaged: bool = False,
    abandon: AbstractSet[str] = frozenset(),
) -> MergeReport:
    """Fold every complete build's sealed fragments into the catalog; see the module docstring.

    ``between`` is a test hook called after each step (``root``, ``rows``, ``hashes``). With
    ``skip_damaged`` (a bucket store, where one damaged object must not block every node's
    builds) a build with an unreadable fragment is left unmerged and named in
    ``report.damaged``; everything else merges. ``abandon``: roots whose unfinished builds
    are retired (parts killed for good: see the module docstring), named in
    ``report.abandoned``.

    Raises:
        ConfigError: a root in ``abandon`` has no unfinished build here (nothing is changed).
        StoreCorrupt: a fragment is unreadable (the message says to move it aside), unless
            ``skip_damaged``.
        StoreError: the catalog cannot be written.

    Example:
        >>> report = merge(Layout(Path(".featbake")))  # doctest: +SKIP
        >>> report.roots, [p.describe() for p in report.pending]  # doctest: +SKIP
    """
    # One merge at a time: a second, having listed and read a build's fragments, folded them
    # again after the first had removed them. It waits, then lists what is left.
    with merging_alone(layout):
        return _merged(layout, between, skip_damaged, abandon)


def merging_alone(layout: Layout, where: str = "") -> contextlib.AbstractContextManager[None]:
    """Hold the store's merge lock (``<layout>/merge.lock``); where another merge holds it, say
    once that this one waits for it (a long merge: a wait in silence looks like a hang), then
    wait (:func:`alone`). ``where``: how the message names the store (default: its folder; a
    bucket's merge names the bucket and this node's local cache, whose lock it takes)."""
    return alone(
        layout.root / MERGE_LOCK,
        f"another merge of {where or layout.root} is running; this one waits for it to finish, "
        "then merges what is left",
        MergeWaitWarning,
    )


class MergeWaitWarning(UserWarning):
    """A merge waits for another merge of the same store (:func:`merging_alone`)."""


#: ``<store>/merge.lock``: held by a merge for its whole run.
MERGE_LOCK = "merge.lock"


def _merged(
    layout: Layout,
    between: Callable[[str], None] | None,
    skip_damaged: bool,
    abandon: AbstractSet[str],
) -> MergeReport:
    """:func:`merge`'s work, with the store's merge lock held."""
    report = MergeReport()
    builds = _by_build(layout)
    complete = {b: n for b, n in builds.items() if _is_complete(n)}
    waiting = {b: n for b, n in builds.items() if b not in complete}
    if abandon:
        abandon = abandoned_roots(layout, abandon)
    serving = serving_fragments(layout)
    if not builds and not serving:
        if layout.catalog.exists() and Path(f"{layout.catalog}-journal").exists():
            # Left by a writer killed mid-transaction (a merge, on a shared filesystem): readers
            # open the catalog read-only and cannot roll it back; a read-write read does.
            with Catalog(layout) as catalog:
                catalog.roots()
        report.pending = pending_builds(layout)
        return report
    catalog = Catalog(layout)
    # A merge inserts up to millions of rows into key-ordered indexes: a big page cache keeps
    # those inserts from re-reading the same B-tree pages (this connection only, freed at close).
    catalog.conn.execute("PRAGMA cache_size=-262144")
    try:
        frags = _readable(complete, layout, report if skip_damaged else None)
        # Every build's, finished or not, dropped before any fold and after each: a build's
        # fragments are removed once folded, with what they say. (Those read whole already
        # are not opened again.)
        read = [f for build in frags.values() for f in build]
        named = {f.path for f in read}
        others = (n.path for names in builds.values() for n in names if n.path not in named)
        void = Replacements.of([*map(replacing, read), *map(replacing_of, others)])
        report.void_rows = void.drop_void(catalog)
        # Oldest build first, so a newer build of the same root publishes its manifest last.
        for bid in sorted(frags, key=lambda b: max(f.created for f in frags[b])):
            _fold_build(catalog, frags[bid], report, between, void.rows)
            for f in frags[bid]:
                with contextlib.suppress(FileNotFoundError):
                    f.path.unlink()
            fsync_dir(fragments_dir(layout))
            report.fragments += len(frags[bid])
        fold_waiting(catalog, waiting, report, void, abandon)
        if serving:
            readable = _readable_serving(serving, layout, skip_damaged, report)
            _fold_serving(catalog, readable, report, void.rows)
    finally:
        catalog.close()
    report.pending = pending_builds(layout)
    return report


def _fold_build(
    catalog: Catalog,
    frags: list[Fragment],
    report: MergeReport,
    between: Callable[[str], None] | None,
    void: VoidRows,
) -> None:
    """Fold one finished build: its encoder and root manifest, then its shards' rows less the
    ``void`` ones, then its hash rows (the module docstring's steps 1 to 3)."""
    done: dict[int, Fragment] = {}
    for f in frags:  # a rank run twice before a merge: its newest manifest slice counts
        rank = f.info.rank
        if f.kind is FragmentKind.DONE and (rank not in done or f.created > done[rank].created):
            done[rank] = f
    info = done[0].info
    when = max(f.created for f in done.values())
    catalog.record_encoder(info.encoder_fp, info.encoder_label, info.encoder_kind, now=when)
    current = catalog.root(info.root)
    items: list[ManifestItem] | None = None  # published here: a later build of this root wins
    if current is None or current.last_used <= when:
        items = sorted(item for f in done.values() for item in f.items)
        _publish_root(catalog, info, items, when)
        catalog.record_held(info.root, {})  # a build decides every row again
        report.roots.append(info.root)
        _record_fidelity(catalog.layout, info.root, list(done.values()))
    if between:
        between("root")
    fold_newest_first(catalog, frags, report, void)
    if items is not None:
        _record_undecodable(catalog, info.root, items, list(done.values()))
    if between:
        between("rows")
    put_fragment_hashes(catalog, [h for f in frags for h in f.hashes])
    if between:
        between("hashes")


def fold_waiting(
    catalog: Catalog,
    waiting: dict[str, list[FragmentName]],
    report: MergeReport,
    void: Replacements,
    abandon: AbstractSet[str] = frozenset(),
) -> None:
    """Fold the shards' rows of builds not finished yet (``waiting``: build id -> its sealed
    fragments) into the catalog, less the ``void`` rows, and retire each such build a later
    build of its root superseded, or whose root is in ``abandon``. A build with an unreadable
    fragment is left as it is (``pending`` names it)."""
    for names in waiting.values():
        try:
            frags = [_read(n.path, catalog.layout) for n in names]
        except StoreCorrupt:
            continue
        folded = MergeReport()
        fold_newest_first(catalog, frags, folded, void.rows)  # as a finished build's
        report.waiting_shards += folded.shards
        report.new_features += folded.new_features
        report.missing_shards += folded.missing_shards
        root = frags[0].info.root
        retired = report.abandoned if root in abandon else None
        if retired is None and _superseded(catalog, frags):
            retired = report.superseded
        if retired is not None:
            for f in frags:
                with contextlib.suppress(FileNotFoundError):
                    f.path.unlink()
            fsync_dir(fragments_dir(catalog.layout))
            if root not in retired:
                retired.append(root)
            report.fragments += len(frags)


def abandoned_roots(layout: Layout, abandon: AbstractSet[str]) -> frozenset[str]:
    """The roots with an unfinished build in ``layout`` that ``abandon`` names, each by its
    name or a unique prefix of it (as `featbake roots drop` takes one); a name that names none
    (a typo, or a build merged or retired since) is refused before anything is changed.

    Raises:
        ConfigError: naming the roots whose builds wait, or saying none does.
    """
    waiting = sorted({p.root for p in pending_builds(layout)})
    known = set(waiting)
    if layout.catalog.exists():  # a prefix names one root among all, not only the waiting
        with Catalog(layout) as catalog:
            known |= {r.name for r in catalog.roots()}
    out = set()
    for name in sorted(abandon):
        found = roots_named(name, sorted(known)) or []
        if len(found) != 1 or found[0] not in waiting:
            listed = ", ".join(waiting) if waiting else "none"
            what = "names more than one" if len(found) > 1 else "names no"
            raise ConfigError(
                f"--abandon {name} {what} root with an unfinished build waiting to be merged "
                f"(roots with one: {listed}); nothing was changed"
            )
        out.add(found[0])
    return frozenset(out)


def fold_newest_first(
    catalog: Catalog, frags: Sequence[Fragment], report: MergeReport, void: VoidRows
) -> None:
    """Fold the shards' rows of ``frags`` into the catalog, newest fragment first, less the
    ``void`` ones: the first row of a key folded wins, so a feature a build stored again (a
    later padding check found it inexact, see bake/pipeline.py) in a later fragment wins over
    the one stored before (which :class:`Replacements` voids)."""
    for f in sorted(frags, key=lambda f: f.created, reverse=True):
        _add_shards(catalog, f, report, void)


@dataclass(frozen=True)
class Replacements:
    """The keys sealed fragments replace, each with when the newest of those was sealed, and
    when each fragment was sealed with the shards it names.

    A build that stores features again (a failed padding check found them inexact) forgets
    their keys first; where its rows go to fragments, its fragment catalog seals one at once
    saying it replaces them (:meth:`featbake.store.fragment_catalog.FragmentCatalog.
    forget_keys`). The rows of such a key in shards recorded at or before then are void,
    whichever build or catalog version holds them (a merge that folded a build while it
    waited puts its padded rows in a bucket's published version; an engine's workers seal
    theirs under a build id of their own), except in a shard a fragment sealed after names
    again, or a writer recorded again after (the catalog keeps a shard's latest recording,
    :func:`featbake.store.catalog.insert_shard`): shards are named by their bytes, and the
    same features stored again make the same shard. A merge drops the void rows before it
    folds (so the rows stored again are not passed over as a key already held), and its folds
    copy none (:attr:`rows`), so that no commit of a merge killed anywhere holds one (before,
    each fold was followed by a drop in a transaction of its own: a merge killed between the
    two served the old row until the next merge); :func:`adopt_sealed_parts` likewise. A key
    not stored again is then a miss, encoded when read, never the old row."""

    at: dict[str, float]
    sealed: tuple[tuple[float, frozenset[str]], ...] = ()

    @classmethod
    def of(cls, fragments: Iterable[Replacing | None]) -> Replacements:
        read = [f for f in fragments if f is not None]
        at: dict[str, float] = {}
        for f in read:
            for key in f.replaced:
                at[key] = max(at.get(key, f.created), f.created)
        return cls(at, tuple((f.created, f.shards) for f in read if at))

    @functools.cached_property
    def rows(self) -> VoidRows:
        """The void rows as a fold skips them: each replaced key's time, and when a fragment
        last named each shard (a shard named after a key's replacement holds no void row)."""
        named: dict[str, float] = {}
        for created, names in self.sealed:
            for name in names:
                named[name] = max(named.get(name, created), created)
        return VoidRows(self.at, named)

    def named_after(self, when: float) -> set[str]:
        """The shards fragments sealed after ``when`` name."""
        return {name for created, names in self.sealed if created > when for name in names}

    def drop_void(self, catalog: Catalog) -> int:
        """Delete the void rows (see the class docstring) from ``catalog``; how many."""
        by_time: dict[float, list[str]] = defaultdict(list)
        for key, when in self.at.items():
            by_time[when].append(key)
        return sum(
            catalog.forget_rows_sealed_by(sorted(keys), when, self.named_after(when))
            for when, keys in sorted(by_time.items())
        )


def sealed_replacements(layout: Layout) -> Replacements:
    """What every sealed build fragment says of keys stored again, as a merge reads it (gc's
    compaction ages the shards it writes by it: ``featbake.upkeep.gc.Compaction``)."""
    names = [n.path for names in _by_build(layout).values() for n in names]
    return Replacements.of(map(replacing_of, names))


def replacing(f: Fragment) -> Replacing:
    """What a fragment read whole says of keys stored again."""
    return Replacing(f.created, f.replaced, frozenset(s.name for s in f.shards))


def _superseded(catalog: Catalog, frags: Sequence[Fragment]) -> bool:
    """True when the catalog's root of these fragments' build (same encoder and recipe) was
    published after the last of them was sealed: its manifest names what they would."""
    info = frags[0].info
    root = catalog.root(info.root)
    return (
        root is not None
        and (root.encoder_fp, root.recipe_fp) == (info.encoder_fp, info.recipe_fp)
        and root.last_used >= max(f.created for f in frags)
    )


def adopt_sealed_parts(catalog: Catalog) -> int:
    """Add to ``catalog`` the shards every sealed build fragment names (finished or not); the
    number of feature rows new to it.

    A build in one process writes the catalog itself: before it looks for what is stored, the
    shards a part killed before its end sealed (or parts not merged yet) are its too, so it
    encodes none of them again. Manifests are left to ``featbake merge``; a fragment merged
    (and removed) meanwhile is skipped, its rows are in the catalog already.

    Newest first, as a merge folds them (see :func:`fold_waiting`): a Ray build's second pass
    stored alone, in later fragments, what a failed padding check made inexact; the first
    row folded wins. Before, a plain rerun after a Ray driver killed between that pass and
    its merge adopted them in their names' order and could keep the padded row.
    """
    adopted = MergeReport()
    frags: list[Fragment] = []
    for name in sealed_fragments(catalog.layout):
        if name.kind is FragmentKind.SERVE or not name.path.exists():
            continue
        try:
            frags.append(_read(name.path, catalog.layout))
        except (StoreCorrupt, sqlite3.Error):
            continue  # unreadable, or merged meanwhile: its keys are encoded or in the catalog
    void = Replacements.of(map(replacing, frags))  # as a merge drops them: never adopted
    void.drop_void(catalog)
    for f in sorted(frags, key=lambda f: f.created, reverse=True):
        try:  # its rows are copied from the file (ATTACH): merged and removed meanwhile
            _add_shards(catalog, f, adopted, void.rows)
        except (StoreCorrupt, sqlite3.Error):
            continue
    return adopted.new_features


def _record_fidelity(layout: Layout, root: str, done: Sequence[Fragment]) -> None:
    """Pool what the ranks of an int8/fp8 build measured and record it beside the root (no
    record when none measured anything: the root's earlier one stands)."""
    pooled: Measured | None = None
    bound: float | None = None
    for f in done:
        if not f.fidelity:
            continue
        try:
            doc = json.loads(f.fidelity)
            part, bound = Measured.from_json(doc["measured"]), doc["bound"]
        except (ValueError, KeyError, TypeError):
            continue  # an unreadable record loses a sample, never the features
        pooled = part if pooled is None else pooled.merged(part)
    if pooled is not None:
        write_fidelity(layout, root, pooled, bound)


def _record_undecodable(
    catalog: Catalog, root: str, items: Sequence[ManifestItem], done: Sequence[Fragment]
) -> None:
    """Record beside ``root`` the inputs its build could not decode: what each rank's ``done``
    fragment names (each part sees only its own failures), with what an earlier build recorded,
    less keys the new manifest does not name or that are stored now (a later part encoded
    them). A dataset then leaves them out, as after a build in one process (store/roots.py).
    After the shards' rows, so "stored" counts this build's own; rewritten alike when a merge
    killed before it runs again."""
    failed = read_undecodable(catalog.layout, root)
    for f in done:
        failed.update(f.undecodable)
    named = {i.key for i in items}
    failed = {k: why for k, why in failed.items() if k in named}
    stored = {k for k, locs in catalog.locate_many(list(failed)).items() if locs}
    write_undecodable(catalog.layout, root, {k: r for k, r in failed.items() if k not in stored})


def _add_shards(catalog: Catalog, f: Fragment, report: MergeReport, void: VoidRows) -> None:
    """Add a fragment's shards and their rows to the catalog (first row wins, as in a build),
    less the ``void`` ones."""
    if f.format_version >= 3:  # a catalog: its rows are copied through ATTACH
        added = catalog.add_fragment_shards(f.path, void=void)
        report.new_features += added.features
        report.shards += added.shards
        report.missing_shards += added.missing
        return
    for shard in read_fragment(f.path, catalog.layout).shards:  # formats 1 and 2
        try:
            report.new_features += catalog.add_shard(shard, now=f.created, void=void)
            report.shards += 1
        except ShardMissing:
            report.missing_shards.append(shard.name)


def _publish_root(
    catalog: Catalog, info: BuildInfo, items: Sequence[ManifestItem], now: float
) -> None:
    """Replace the root a fragment's ``info`` names with ``items`` (path, key), used at ``now``."""
    catalog.replace_root(info.root_spec, [(i.path, i.key) for i in items], now=now)


def _readable(
    complete: dict[str, list[FragmentName]], layout: Layout, damaged: MergeReport | None
) -> dict[str, list[Fragment]]:
    """Each complete build's fragments, read; a build with an unreadable one is left out and
    named in ``damaged.damaged`` (raised when ``damaged`` is None)."""
    out: dict[str, list[Fragment]] = {}
    for build_id, names in complete.items():
        try:
            out[build_id] = [_read(n.path, layout) for n in names]
        except StoreCorrupt:
            if damaged is None:
                raise
            damaged.damaged.extend(n.path.name for n in names if not _is_readable(n, layout))
    return out


def _readable_serving(
    names: list[FragmentName], layout: Layout, skip_damaged: bool, report: MergeReport
) -> list[Fragment]:
    out = []
    for n in names:
        try:
            out.append(_read_serving(n.path, layout))
        except StoreCorrupt:
            if not skip_damaged:
                raise
            report.damaged.append(n.path.name)
    return out


def _is_readable(name: FragmentName, layout: Layout) -> bool:
    try:
        _read(name.path, layout)
    except StoreCorrupt:
        return False
    return True


def _read(path: Path, layout: Layout) -> Fragment:
    """A fragment's meta, manifest, hash rows and uses (its feature rows are copied SQL-side)."""
    return read_fragment(path, layout, with_entries=False)


def _read_serving(path: Path, layout: Layout) -> Fragment:
    """A ``serve`` fragment, read whole.

    Raises:
        StoreCorrupt: it is unreadable (the message says what moving it aside loses).
    """
    try:
        return _read(path, layout)
    except StoreCorrupt as e:
        raise StoreCorrupt(
            f"serving fragment {path} is unreadable ({e.__cause__}); move it aside and merge "
            "again: the features it names are encoded again when next needed"
        ) from e


def _fold_serving(
    catalog: Catalog, frags: list[Fragment], report: MergeReport, void: VoidRows
) -> None:
    """Fold ``serve`` fragments, oldest first (their rows less the ``void`` ones), then their
    last uses; then unlink them."""
    frags.sort(key=lambda f: f.created)
    for f in frags:
        info = f.info
        if info.encoder_kind:  # the dataset had to load the encoder to fingerprint it
            catalog.record_encoder(
                info.encoder_fp, info.encoder_label, info.encoder_kind, now=f.created
            )
        current = catalog.root(info.root) if f.items else None
        if f.items and (current is None or current.last_used <= f.created):
            catalog.record_held(info.root, dict(f.held))  # before the root: never unheld
            _publish_root(catalog, info, f.items, f.created)
            if info.root not in report.roots:
                report.roots.append(info.root)
        _add_shards(catalog, f, report, void)
        put_fragment_hashes(catalog, list(f.hashes))
    # After every shard's rows: a use may name a feature another fragment wrote back.
    catalog.record_uses(u for f in frags for u in f.uses)
    for f in frags:
        with contextlib.suppress(FileNotFoundError):
            f.path.unlink()
    fsync_dir(fragments_dir(catalog.layout))
    report.fragments += len(frags)
    report.serving_fragments += len(frags)


def put_fragment_hashes(catalog: Catalog, rows: list[HashCacheRow]) -> None:
    """Fold fragment hash rows into the catalog, each with the time its stat was taken."""
    # A row recorded at an unknown time is left out: its file is simply hashed again.
    catalog.put_hash_rows(h for h in rows if h.recorded_ns > 0)
