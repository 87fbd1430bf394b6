"""The upkeep commands as users run them: real subprocesses, exit codes, JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zarr

from featbake.testing import TinyConvEncoder, save_torchscript, write_audio_folder
from tests.conftest import REPO, invoke, run_cli
from tests.helpers import (
    COMMAND_THEN_MODULES,
    Live,
    Ran,
    assert_serves,
    bake,
    commands_then_modules,
    one_red_line,
    printed,
    shard_files,
)


@pytest.fixture
def baked(tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path) -> dict:
    other = save_torchscript(TinyConvEncoder(seed=3), tmp_path / "other.pt")
    a = bake(audio_dir, encoder_file, store_dir)
    b = bake(audio_dir / "fixed", other, store_dir)
    return {"a": a, "b": b}


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_stats_roots_gc_export_round(baked: dict, store_dir: Path, tmp_path: Path) -> None:
    a, b = baked["a"], baked["b"]
    s = _json(invoke("stats", "--cache", store_dir, "--json"))
    assert s["features"] == 20 and s["dead_features"] == 0
    assert {r["name"] for r in s["roots"]} == {a.root, b.root}
    text = invoke("stats", "--cache", store_dir)
    assert text.returncode == 0 and a.root in text.stdout and "encoders" in text.stdout

    roots = _json(invoke("roots", "--cache", store_dir, "--json"))
    assert {r["name"]: r["items"] for r in roots} == {a.root: 16, b.root: 4}
    drop = invoke("roots", "--cache", store_dir, "drop", b.root[:8])
    assert drop.returncode == 0 and b.root in drop.stdout, drop.stderr

    dry = _json(invoke("gc", "--cache", store_dir, "--dry-run", "--json"))
    assert dry["plan"]["unreached_features"] == 4
    before = shard_files(store_dir)
    done = _json(invoke("gc", "--cache", store_dir, "--json"))
    assert done["result"]["rows_deleted"] == 4
    assert done["result"]["bytes_freed"] == dry["plan"]["freed_bytes"]
    assert sum(before.values()) - sum(shard_files(store_dir).values()) == dry["plan"]["freed_bytes"]

    out = tmp_path / "a.zarr"
    exp = invoke("export", "--format", "zarr", out, "--cache", store_dir)
    assert exp.returncode == 0, exp.stderr
    assert zarr.open_group(str(out), mode="r")["keys"].shape == (16,)
    bad = invoke("export", "--format", "hdf5", tmp_path / "x", "--cache", store_dir)
    assert bad.returncode == 2 and "zarr" in bad.stderr


@pytest.mark.slow
def test_verify_exit_codes_clean_damaged_repaired(baked: dict, store_dir: Path) -> None:
    assert invoke("verify", "--cache", store_dir).returncode == 0
    victim = sorted(shard_files(store_dir))[0]
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 7)
    damaged = invoke("verify", "--cache", store_dir)
    assert damaged.returncode == 11 and "corrupt-shard" in damaged.stdout
    repaired = _json_rc(invoke("verify", "--cache", store_dir, "--repair", "--json"), 10)
    assert repaired["status"] == "repaired" and repaired["exit_code"] == 10
    assert invoke("verify", "--cache", store_dir).returncode == 0


def _json_rc(proc, rc: int) -> dict:
    assert proc.returncode == rc, proc.stderr
    return json.loads(proc.stdout)


def test_commands_on_a_missing_store_print_one_line(tmp_path: Path) -> None:
    proc = invoke("stats", "--cache", tmp_path / "none")
    assert proc.returncode == 5
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    help_text = invoke("verify", "--help")
    assert "10" in help_text.stdout and "11" in help_text.stdout


@pytest.mark.parametrize("name", ["a\nb", "a\rb", "a\x1b[2Jb", "a\u2028b"])
def test_an_error_naming_a_path_with_a_control_character_stays_one_line(
    tmp_path: Path, name: str
) -> None:
    # A newline (or a carriage return, or a terminal's escape) in a path printed as it is
    # would split the one error line a log greps, or overwrite it.
    odd = tmp_path / name
    odd.mkdir()
    escaped = name.encode("unicode_escape").decode("ascii")
    for proc, code in (
        (invoke("stats", "--cache", odd), 5),
        (invoke("build", "--encoder", odd / "e.pt", "--data", odd, "--cache", tmp_path / "s"), 4),
    ):
        assert proc.returncode == code, printed(proc)
        line = one_red_line(proc)
        assert line.startswith("error:") and escaped in line and "\r" not in proc.stderr[:-1]
        assert "\x1b" not in proc.stderr, line


def test_a_store_holding_only_a_build_in_parts_lists_it_as_pending(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """After the first part of a sharded build (a SLURM array's first task) the store holds
    fragments and no catalog: `roots` and `stats` exited 5 ("cannot be read or written") and
    listed nothing, where docs/scaling.md says they list the build as pending."""
    store = tmp_path / "store"
    built = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", store, "--shard", "0/2")
    assert built.returncode == 0, printed(built)
    for command in ("roots", "stats"):
        got = invoke(command, "--cache", store)
        assert got.returncode == 0, printed(got)
        assert "1 of 2 ranks done" in got.stdout and "featbake merge" in got.stdout, got.stdout
    assert json.loads(invoke("roots", "--cache", store, "--json").stdout) == []
    said = json.loads(invoke("stats", "--cache", store, "--json").stdout)
    assert said["features"] == 0 and said["roots"] == []
    gc = invoke("gc", "--cache", store)  # changing the store waits for the merge
    assert gc.returncode == 5 and "run `featbake merge`" in one_red_line(gc)


def test_export_of_a_store_whose_roots_were_all_dropped_says_there_is_none(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """It said "the store has 0 roots (none); choose one with --root NAME": no root to choose."""
    store = tmp_path / "store"
    built = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", store, "--json")
    root = json.loads(built.stdout)["root"]
    assert invoke("roots", "--cache", store, "drop", root).returncode == 0
    got = invoke("export", tmp_path / "o.parquet", "--cache", store, "--format", "parquet")
    assert got.returncode == 2
    line = one_red_line(got)
    assert "has no root to export" in line and "--root" not in line, line
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.slow
@pytest.mark.parametrize("cycle", [2, 3])
def test_repair_gives_swapped_shard_names_back_and_loses_nothing(
    encoder_file: Path, audio_dir: Path, store_dir: Path, tmp_path: Path, cycle: int
) -> None:
    """Issue 16 item 6: shard names are content hashes, so files whose names were swapped (or
    rotated in a cycle) are renamed back, never quarantined: no feature is lost, and every one
    still equals the encoder run now."""
    from tests.helpers import Live, assert_serves

    report = bake(audio_dir, encoder_file, store_dir, shard_bytes=20_000)
    paths = sorted(shard_files(store_dir))
    assert len(paths) >= cycle
    moved = paths[:cycle]
    stage = tmp_path / "stage"
    stage.mkdir()
    for i, p in enumerate(moved):  # rotate: file i takes file i+1's name
        p.rename(stage / str(i))
    for i in range(cycle):
        (stage / str(i)).rename(moved[(i + 1) % cycle])
    damaged = invoke("verify", "--cache", store_dir)
    assert damaged.returncode == 11, damaged.stderr
    repaired = invoke("verify", "--cache", store_dir, "--repair", "--json")
    assert repaired.returncode == 10, repaired.stderr
    out = json.loads(repaired.stdout)
    assert out["features_lost"] == 0
    assert sum("back to its content name" in a for a in out["actions"]) == cycle
    assert not (store_dir / "quarantine").exists() or not any((store_dir / "quarantine").iterdir())
    assert sorted(shard_files(store_dir)) == paths
    assert invoke("verify", "--cache", store_dir).returncode == 0
    assert assert_serves(store_dir, report.root, audio_dir, encoder_file, Live()) == 16


def test_stats_and_roots_fit_80_columns_and_count_one_way(
    tmp_path: Path, multi_encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Issue 18 item 8: an 80-column terminal cut names and wrapped dates, piped output ran to
    435 characters ignoring COLUMNS, and the summary counted features where the encoders
    table counted tensors, unlabelled."""
    import re

    data = tmp_path / ("a_folder_with_a_long_name_" * 2) / "audio"
    data.parent.mkdir(parents=True)
    audio_dir.rename(data)
    report = bake(data, multi_encoder_file, store_dir)  # 2 outputs: 2 tensors per feature
    env = {"COLUMNS": "80"}
    for cmd in ("stats", "roots"):
        res = invoke(cmd, "--cache", store_dir, env=env)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        # a path is never split or cut: it may run past (the store's was cut with "...")
        paths = (str(data), str(multi_encoder_file), str(store_dir))
        long = [ln for ln in lines if len(ln) > 80 and not any(p in ln for p in paths)]
        assert not long, res.stdout
        assert any(report.root in ln for ln in lines)  # the whole name, never cut
        head = next(ln for ln in lines if ln.startswith(report.root))
        assert re.search(r"last used \d{4}-\d\d-\d\d \d\d:\d\d$", head), head
        assert any(ln.strip() == f"data     {data}" for ln in lines)  # the path whole
        assert cmd == "roots" or f"store     {store_dir}" in lines, res.stdout
    stats = invoke("stats", "--cache", store_dir, env=env).stdout
    assert "16 inputs, 32 tensors" in stats
    assert re.search(r"^[0-9a-f]{12}  32 tensors, ", stats, re.MULTILINE), stats


def test_the_recipe_line_tells_roots_apart_by_layers_and_precision() -> None:
    from featbake.cli.upkeep import recipe_brief
    from featbake.recipe import Recipe

    plain = Recipe().as_dict()
    six = {**plain, "layers": [0, 6], "precision": "bf16"}
    assert recipe_brief(plain) != recipe_brief(six)
    assert recipe_brief(six).endswith("layers 0,6 bf16 compute")


def test_an_older_crop_is_told_apart_and_said_as_what_it_is() -> None:
    """A ``--max-seconds`` store made before crops read the resampler's whole context is its
    own root (its key lacks ``crop``): ``featbake roots`` showed it as the new one, and a miss
    said "crop=None in the store, 2 asked", an option no one can pass."""
    from featbake.cli.upkeep import recipe_brief
    from featbake.recipe import Recipe
    from featbake.serve.misses import recipe_differences

    now = Recipe(max_seconds=10.0).as_dict()
    older = {k: v for k, v in now.items() if k != "crop"}
    assert recipe_brief(now).endswith("crop 10s") and recipe_brief(older).endswith("(older crop)")
    (said,) = recipe_differences(now, older)
    assert "made by an older featbake" in said and "build it again" in said
    assert "crop=" not in said
    # Cropped against whole files (either way round): max_seconds says it, not the version.
    whole = Recipe().as_dict()
    for asked, stored in ((now, whole), (whole, now)):
        (differs,) = recipe_differences(asked, stored)
        assert differs.startswith("max_seconds="), differs


def _one_error_line(proc, starts: str) -> None:
    """Exit 5 and one red line (no internal error, no traceback)."""
    assert proc.returncode == 5, proc.stdout + proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.strip()]
    assert errors[-1].startswith(f"error: {starts}"), errors
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_store_whose_fragments_or_quarantine_is_a_file_is_one_line_everywhere(
    encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """Round six, upkeep: `fragments` (where a build in parts seals its fragments) as a file
    ended stats, gc, verify, verify --repair and merge in an internal error
    (NotADirectoryError); `quarantine` as a file ended verify --repair in one (FileExistsError)
    after it had begun to change the store. Each is one line now, exit 5, and repair refuses
    before it changes anything."""
    report = bake(audio_dir / "fixed", encoder_file, store_dir)
    (store_dir / "fragments").write_text("not a folder")
    for args in (("stats",), ("gc",), ("verify",), ("verify", "--repair"), ("merge",)):
        run = run_cli if args == ("gc",) else invoke
        _one_error_line(run(*args, "--cache", store_dir), "cannot list the store's fragments")
    (store_dir / "fragments").unlink()

    (store_dir / "quarantine").write_text("not a folder")
    (store_dir / "catalog.sqlite").rename(store_dir / "elsewhere.sqlite")  # damage to repair
    proc = run_cli("verify", "--repair", "--cache", store_dir)
    _one_error_line(proc, f"{store_dir / 'quarantine'} is not a folder")
    assert not any(store_dir.glob("catalog.moving")) and not any(store_dir.glob("catalog.reb*"))
    (store_dir / "quarantine").unlink()
    assert invoke("verify", "--repair", "--cache", store_dir).returncode == 10
    assert invoke("verify", "--cache", store_dir).returncode == 0
    assert assert_serves(store_dir, report.root, audio_dir / "fixed", encoder_file, Live()) == 4


def test_a_store_whose_roots_is_a_file_is_one_line_and_repaired_once_moved_aside(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, store_dir: Path
) -> None:
    """`roots` (a manifest per root) as a file was read as an empty folder: verify called every
    root's manifest gone ("its manifest file is gone"), and --repair, a build and a drop then
    failed to write one with the OS's "File exists", which said nothing of why. Each command
    that reads or writes manifests says it in one line now (exit 5); those that read the
    catalog alone (stats, serving) go on; once the file is moved aside, --repair writes the
    manifests anew and the store is clean."""
    report = bake(audio_dir / "fixed", encoder_file, store_dir)
    (store_dir / "roots").rename(tmp_path / "roots.kept")
    (store_dir / "roots").write_text("not a folder")
    more = tmp_path / "more"
    more.mkdir()
    (more / "a.wav").write_bytes(next((audio_dir / "fixed").glob("*.wav")).read_bytes())
    for args in (
        ("verify",),
        ("verify", "--repair"),
        ("gc",),
        ("roots", "drop", report.root),
        ("build", "--encoder", encoder_file, "--data", more),
    ):
        _one_error_line(
            invoke(*args, "--cache", store_dir), f"{store_dir / 'roots'} is not a folder"
        )
    assert invoke("stats", "--cache", store_dir).returncode == 0
    assert assert_serves(store_dir, report.root, audio_dir / "fixed", encoder_file, Live()) == 4
    (store_dir / "roots").unlink()
    assert invoke("verify", "--repair", "--cache", store_dir).returncode == 10
    assert invoke("verify", "--cache", store_dir).returncode == 0
    assert (store_dir / "roots" / f"{report.root}.json").is_file()
    assert assert_serves(store_dir, report.root, audio_dir / "fixed", encoder_file, Live()) == 4


def test_what_a_build_that_failed_at_once_left_is_nothing_built_for_every_command(
    tmp_path: Path, encoder_file: Path
) -> None:
    """A build over a folder with no input files fails before its first shard, leaving empty
    ``shards/`` and ``tmp/``; and an empty folder. Each upkeep command says nothing is built
    there yet, in one line, exit 5. Before, `stats` said to run `featbake verify --repair`,
    `verify` called the store damaged, and the repair then made an empty catalog of nothing."""
    (tmp_path / "empty").mkdir()
    store = tmp_path / "store"
    r = invoke("build", "--encoder", encoder_file, "--data", tmp_path / "empty", "--cache", store)
    assert r.returncode == 8 and "no input files" in r.stderr
    assert (store / "shards").is_dir()  # the shell the failed build left
    for command in (["stats"], ["verify"], ["verify", "--repair"], ["gc"]):
        r = invoke(*command, "--cache", store)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 5, (command, r.stdout + r.stderr)
        assert len(lines) == 1 and f"nothing is built in {store} yet" in lines[0], lines
    assert not (store / "catalog.sqlite").exists()
    r = invoke("stats", "--cache", tmp_path / "empty")  # verify says "not a featbake store"
    assert r.returncode == 5 and "nothing is built in" in r.stderr and "--repair" not in r.stderr


def test_gc_on_a_store_read_only_here_refuses_before_it_shows_a_plan(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """`gc` on a store this process may only read says so in one line before anything else,
    exit 5; `gc --dry-run` there still shows its plan. Before, gc printed "nothing to do" (or
    what it would free) and then said it could not write."""
    store = tmp_path / "store"
    bake(audio_dir, encoder_file, store)
    env = {"FEATBAKE_READ_ONLY": "1"}
    r = invoke("gc", "--cache", store, env=env)
    assert r.returncode == 5 and r.stdout == "", r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"the store {store} is read-only here" in lines[0]
    r = invoke("gc", "--dry-run", "--cache", store, env=env)
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr


def test_options_for_the_other_kind_of_store_are_said_to_do_nothing(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """`--retention`, `--local-cache` and `--local-cache-size` act on a bucket store only, and
    `--grace` on a directory only: given for the other kind, each was silently ignored (a user
    setting `--retention 30d` on a directory store believed its unnamed shards were kept 30
    days; they went after the 1 h grace). Each is now one note line, the command runs as
    before, and what the environment sets for a whole node is not noted."""
    store = tmp_path / "store"
    bake(audio_dir, encoder_file, store)
    r = invoke(
        "gc", "--dry-run", "--retention", "30d", "--grace", "2h", "--local-cache", tmp_path / "t",
        "--cache", store,
    )  # fmt: skip
    assert r.returncode == 0 and "nothing to do" in r.stdout, r.stdout + r.stderr
    notes = r.stderr.strip().splitlines()
    assert [n.split(":")[1].strip() for n in notes] == [
        f"--local-cache does nothing for a directory store ({store})",
        f"--retention does nothing for a directory store ({store})",
    ], notes
    assert "its unnamed shards wait out --grace" in notes[1]
    env = {"FEATBAKE_LOCAL_CACHE": str(tmp_path / "t"), "FEATBAKE_LOCAL_CACHE_SIZE": "1GiB"}
    for args in (("stats",), ("roots",), ("gc", "--dry-run")):
        quiet = invoke(*args, "--cache", store, env=env)
        assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    sized = invoke("stats", "--local-cache-size", "1GiB", "--cache", store)
    assert sized.returncode == 0 and sized.stderr.startswith(
        f"note: --local-cache-size does nothing for a directory store ({store})"
    ), sized.stderr


@pytest.mark.slow
def test_upkeep_commands_never_import_torch(baked: dict, store_dir: Path) -> None:
    """stats, roots, roots drop, gc (plan, drop, sweep), verify, merge and --help read the
    catalog and the shards' bytes with no tensor: they must not pay torch's import (~1 s of
    a ~1.9 s `featbake stats`), and they still say what they said with it."""
    a, b = baked["a"], baked["b"]
    cache = ["--cache", str(store_dir)]
    commands = [
        ["stats", *cache, "--json"],
        ["roots", *cache, "--json"],
        ["verify", *cache, "--json"],
        ["roots", *cache, "drop", b.root],
        ["gc", *cache, "--dry-run", "--json"],
        ["gc", *cache, "--json"],
        ["merge", *cache],
        ["--help"],
        ["gc", "--help"],
        ["export", "--help"],
    ]
    ran = commands_then_modules(commands)
    assert all(r.code == 0 and not r.imported for r in ran), [(r.code, r.imported) for r in ran]
    outputs = ["\n".join(r.out) for r in ran]
    stats, roots, verify, drop, dry, gc, merge, app_help, gc_help, export_help = outputs
    assert json.loads(stats)["features"] == 20
    assert {r["name"]: r["items"] for r in json.loads(roots)} == {a.root: 16, b.root: 4}
    assert json.loads(verify)["status"] == "clean"
    assert f"dropped root {b.root}" in drop
    assert json.loads(dry)["plan"]["unreached_features"] == 4
    done = json.loads(gc)["result"]
    assert done["rows_deleted"] == 4 and done["shards_written"] == 0
    assert "nothing to merge" in merge
    assert "stats" in app_help and "--grace" in gc_help and "--format" in export_help


def test_an_unknown_export_format_is_one_line_without_torch(tmp_path: Path) -> None:
    """`featbake export --format npy` imported the export's modules (torch, seconds of CPU)
    before saying the format is unknown."""
    args = ["export", "--format", "npy", str(tmp_path / "out"), "--cache", str(tmp_path / "c")]
    ran = subprocess.run([sys.executable, "-c", COMMAND_THEN_MODULES, *args],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"},
                         timeout=120)  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown --format 'npy'" in lines[0], lines
    assert ran.stdout.strip() == "imported: []", ran.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()


#: `featbake export`'s refusals, in the order one interpreter runs them (see
#: :func:`export_refusals`): argument lists with ``{out}`` (an export path, written by
#: ``exported``), ``{store}`` (two roots: ``{a}``, and ``{b}`` whose data changed since the
#: build) and ``{none}`` (no store), the exit code, and what the one line says. Two mistakes
#: name the one the export named before torch left its import (checked in this order: --format,
#: --compression, the store, OUT, the root, the parts, the data).
EXPORT_REFUSALS: dict[str, tuple[str, int, str]] = {
    "format": ("--format npy {out} --cache {store}", 2, "unknown --format 'npy'"),
    "compression": ("{out} --cache {store} --root {a} --compression lz4", 2,
                    "unknown compression 'lz4'; choose one of none, snappy, zstd"),
    "webdataset compressed": ("--format webdataset {out} --cache {store} --root {a} "
                              "--compression zstd", 2, "a webdataset export writes plain tars"),
    "no store": ("{out} --cache {none}", 5, "there is no featbake store at {none}"),
    "no such root": ("{out} --cache {store} --root nope", 2, "no root is named 'nope'"),
    "several roots": ("{out} --cache {store}", 2, "the store has 2 roots"),
    "no such part": ("{out} --cache {store} --root {a} --output nope", 2,
                     "the root stores no part 'nope'"),
    "data changed, strict": ("{out} --cache {store} --root {b} --strict-rows", 2,
                             "1 of 2 items of root {b} changed in its data"),
    "no store and compression": ("{out} --cache {none} --compression lz4", 2,
                                 "unknown compression 'lz4'"),
    "no such root and compression": ("{out} --cache {store} --root nope --compression lz4", 2,
                                     "unknown compression 'lz4'"),
    "exported": ("{out} --cache {store} --root {a}", 0, ""),
    "OUT exists": ("{out} --cache {store} --root {a}", 2,
                   "{out} exists; choose another OUT or pass --overwrite"),
    "OUT exists and no such root": ("{out} --cache {store} --root nope", 2, "{out} exists"),
    "no store and OUT exists": ("{out} --cache {none}", 5, "there is no featbake store"),
}  # fmt: skip


@pytest.fixture(scope="module")
def export_refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Ran, dict]]:
    """Every :data:`EXPORT_REFUSALS` command run in turn in one fresh interpreter (torch's
    import alone is seconds of CPU: one interpreter, not one per case), by name, with the
    names its arguments were filled in with."""
    t = tmp_path_factory.mktemp("export-refusals")
    encoder = save_torchscript(TinyConvEncoder(), t / "encoder.pt")
    write_audio_folder(t / "a", 4, seconds=(0.3, 0.6))
    clips = write_audio_folder(t / "b", 2, seconds=(0.3, 0.6), seed=2)
    a, b = bake(t / "a", encoder, t / "store").root, bake(t / "b", encoder, t / "store").root
    write_audio_folder(t / "new", 1, seconds=0.5, seed=9)[0].replace(clips[0])  # changed
    names = {"out": str(t / "out.zarr"), "store": str(t / "store"), "none": str(t / "none"),
             "a": a, "b": b}  # fmt: skip
    commands = [["export", *args.format(**names).split()] for args, _, _ in
                EXPORT_REFUSALS.values()]  # fmt: skip
    return {name: (ran, names) for name, ran in
            zip(EXPORT_REFUSALS, commands_then_modules(commands), strict=True)}  # fmt: skip


@pytest.mark.parametrize("case", list(EXPORT_REFUSALS))
def test_an_export_refusal_is_one_line_without_torch(
    export_refusals: dict[str, tuple[Ran, dict]], case: str
) -> None:
    """`featbake export` imported torch (export/source.py at its top: 4-5 s of CPU) before
    saying the root, the compression, the store or OUT was wrong. Each refusal is its one line
    and exit code as before, with no torch imported by the refusal or any command run before
    it in the same interpreter; an export of float features imports none either."""
    ran, names = export_refusals[case]
    _, code, said = EXPORT_REFUSALS[case]
    assert ran.code == code, ran
    assert ran.imported == [], ran
    if code == 0:
        assert len(ran.out) == 1 and ran.out[0].startswith(f"exported 4 items of root {names['a']}")
        assert zarr.open_group(names["out"], mode="r")["keys"].shape == (4,)
        return
    assert len(ran.err) == 1 and said.format(**names) in ran.err[0], ran
    assert ran.out == [], ran


def test_an_eof_error_inside_a_command_is_that_error_not_aborted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Click turns an ``EOFError`` raised anywhere in a command into its ``Abort``: a library
    reading a truncated file (here a damaged bytecode file of zarr's, met while importing it)
    made ``featbake export`` say ``aborted``, exit 130, as if the user had pressed Ctrl-C. It
    is the internal error it is, in one line."""
    import featbake.upkeep

    def truncated(store: object) -> None:
        raise EOFError("marshal data too short")

    monkeypatch.setattr(featbake.upkeep, "stats", truncated)
    (tmp_path / "store").mkdir()
    r = invoke("stats", "--cache", tmp_path / "store")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stderr)
    assert "EOFError: marshal data too short" in lines[0] and "aborted" not in r.stderr


def test_an_empty_argument_is_refused_before_anything_is_read_or_written(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A script's unset variable: ``--cache ""`` was the current folder (a build made a store
    there, and its gc emptied the user's ``tmp/``), ``roots drop ""`` dropped the one root
    an empty prefix matched, ``--data ""`` built the whole current folder. Each is one line,
    exit 2, and nothing changes."""
    store = tmp_path / "store"
    assert invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", store).returncode == 0
    before = sorted(p.name for p in store.iterdir())
    calls = [
        ("gc", "--cache", ""),
        ("gc", "--cache=", "--dry-run"),
        ("roots", "--cache", store, "drop", ""),
        ("build", "-e", encoder_file, "-d", "", "--cache", store),
        ("export", " ", "--cache", store),
    ]
    for call in calls:
        r = invoke(*call)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 2 and len(lines) == 1 and "is empty" in lines[0], (call, r.stderr)
    assert sorted(p.name for p in store.iterdir()) == before
    assert "r-" in invoke("roots", "--cache", store).stdout  # the root is still there


def test_a_folder_of_the_users_is_never_made_a_store(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """``build --cache DIR`` made a store in any folder, one holding the user's own files
    and a ``tmp/`` of theirs included (the data folder itself too): gc then emptied that
    ``tmp/``. A folder holding files and none of a store's is refused in one line; an empty
    or new folder, or a store, is built into as before."""
    mine = tmp_path / "project"
    (mine / "tmp").mkdir(parents=True)
    (mine / "tmp" / "notes.txt").write_text("mine")
    (mine / "train.py").write_text("print()")
    for folder in (mine, audio_dir):
        r = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", folder)
        lines = [line for line in r.stderr.splitlines() if line.strip().startswith("error")]
        assert r.returncode == 2 and len(lines) == 1, r.stderr
        assert "holds files of its own" in lines[0] and "no featbake store" in lines[0]
    assert sorted(p.name for p in mine.iterdir()) == ["tmp", "train.py"]
    assert not list(audio_dir.rglob("*.sqlite"))
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "new", tmp_path / "empty"):  # then a store
        r = invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", folder)
        assert r.returncode == 0, r.stderr


#: A command run after ``featbake.MODULE.NAME`` is made to send this process ``SIG`` each time
#: it is called (then do its work): a stop that lands exactly there, whatever the load.
STOPPED_AT = """
import os, signal, sys, importlib
module, name, sig = sys.argv[1:4]
m = importlib.import_module(module)
real = getattr(m, name)
def stopping(*args, **kwargs):
    os.kill(os.getpid(), getattr(signal, sig))
    return real(*args, **kwargs)
setattr(m, name, stopping)
from featbake.cli.main import main
main(sys.argv[4:])
"""


@pytest.mark.parametrize(
    ("module", "name", "sig", "code"),
    [
        ("featbake.export.zarr", "_copy_features", "SIGINT", 130),  # as zarr writes
        ("featbake.export.zarr", "_copy_features", "SIGTERM", 143),
        ("featbake.encode.inputs", "DigestView", "SIGTERM", 143),  # reading the root's data
    ],
)
def test_an_export_stopped_anywhere_says_so_leaves_nothing_and_reruns(
    tmp_path: Path, encoder_file: Path, audio_dir: Path, module: str, name: str, sig: str,
    code: int,
) -> None:  # fmt: skip
    """Ctrl-C or SIGTERM mid-export: zarr's own thread went on writing while the partial
    output was removed ("Directory not empty", exit 5, ``OUT.partial`` left, and the rerun
    refused it); a SIGTERM while the root's data was read was taken for an unreadable input
    (exit 0, false warnings). Each now stops between runs of items: its one line and code,
    no OUT, no ``OUT.partial``, and the rerun exports."""
    store = tmp_path / "store"
    assert invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", store).returncode == 0
    out = tmp_path / "f.zarr"
    proc = subprocess.run(
        [sys.executable, "-c", STOPPED_AT, module, name, sig, "export", str(out), "--cache",
         str(store)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip() and ":" in line]
    said = [line for line in lines if line.startswith(("stopped:", "interrupted:"))]
    assert proc.returncode == code and len(said) == 1, proc.stderr
    assert "export was not written" in said[0] and "Traceback" not in proc.stderr
    assert not out.exists() and not (tmp_path / "f.zarr.partial").exists()
    assert not (tmp_path / "f.zarr.lock").exists()
    again = invoke("export", out, "--cache", store)
    assert again.returncode == 0, again.stderr


def test_a_spot_check_stopped_between_items_exits_with_its_code(
    tmp_path: Path, encoder_file: Path, audio_dir: Path
) -> None:
    """A SIGTERM raised inside decoding (soundfile's callback, or the decode itself) was taken
    for an unreadable input, or ignored: ``verify --encoder`` went on and exited 0. It stops
    between items now, in one line, exit 143."""
    store = tmp_path / "store"
    assert invoke("build", "-e", encoder_file, "-d", audio_dir, "--cache", store).returncode == 0
    proc = subprocess.run(
        [sys.executable, "-c", STOPPED_AT, "featbake.serve.spot_check", "decode_items",
         "SIGTERM", "verify", "--cache", str(store), "--encoder", str(encoder_file),
         "--data", str(audio_dir)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"},
    )  # fmt: skip
    said = [line for line in proc.stderr.splitlines() if line.startswith("stopped:")]
    assert proc.returncode == 143 and len(said) == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "mismatched" not in proc.stdout


def test_merge_of_a_folder_that_is_not_a_store_is_refused(tmp_path: Path) -> None:
    """``merge --cache`` at a folder of another program's files (or an empty one) said
    "nothing to merge", exit 0: a job merging into the wrong place succeeded. Refused in one
    line, exit 5, as stats, gc and verify refuse it."""
    other = tmp_path / "otherprog"
    other.mkdir()
    (other / "data.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    for folder in (other, tmp_path / "empty"):
        r = invoke("merge", "--cache", folder)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == 5 and len(lines) == 1 and "not a featbake store" in lines[0], r
    assert sorted(p.name for p in other.iterdir()) == ["data.txt"]
