"""The package's layers, checked over the AST of every module (by `make test` and `make lint`).

Imports run one way: leaves <- store <- encode <- {bake, serve} <- cli, and store <- {upkeep,
export} <- cli (docs/design.md, "The parts"). A module may not import the package root, nor
another module's ``_private`` names. Functions stay under ~60 lines, except those named below with
their reason (the same list is in docs/design.md). Modules have no size cap: one module holds one
concept, however long it is (issue 27; diskcache keeps ``Cache`` in one file).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "featbake"

#: layer -> the layers it may import (itself included implicitly).
LEAVES = {
    "errors",
    "keys",
    "recipe",
    "units",
    "lru",
    "progress",
    "version",
    "process",
    "cpus",
    "threadpool",
    "gcpause",
    "quantize",
    "native",
    "kernels",
    "image_recipe",
    "length_batches",
    "cpu_share",
    "pace",
}
ALLOWED: dict[str, set[str]] = {
    "leaf": set(),
    "device": {"leaf"},
    "store": {"leaf"},
    "encode": {"leaf", "device", "store"},
    "bake": {"leaf", "device", "store", "encode"},
    "serve": {"leaf", "device", "store", "encode"},
    "upkeep": {"leaf", "store"},
    "export": {"leaf", "store"},
    "testing": {"leaf", "encode"},
    "cli": {"leaf", "device", "store", "encode", "bake", "serve", "upkeep", "export"},
    "ray": {"leaf", "bake"},  # featbake/ray.py: the public Ray API (bake/ray_engine.py)
    "entry": {"cli"},  # featbake/__main__.py
    "root": {"leaf", "bake", "serve"},  # featbake/__init__.py: the lazy public API
}

MAX_FUNCTION_LINES = 60
#: "module:function" -> why it may be longer (keep in step with docs/design.md).
LONG_FUNCTIONS: dict[str, str] = {}


@dataclass(frozen=True)
class ImportEdge:
    """One ``import`` statement: who imports which featbake module (and which names)."""

    module: str
    target: str
    names: tuple[str, ...]
    line: int
    typing_only: bool = False  # under ``if TYPE_CHECKING:``: never run


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    head = parts[1]
    if head in LEAVES:
        return "leaf"
    if head == "__main__":
        return "entry"
    return head


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def import_edges(path: Path) -> list[ImportEdge]:
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for inner in ast.walk(node)
    }
    edges = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "featbake":
                    edges.append(
                        ImportEdge(me, alias.name, (), node.lineno, id(node) in typing_only)
                    )
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "featbake"
        ):
            names = tuple(a.name for a in node.names)
            edges.append(ImportEdge(me, node.module, names, node.lineno, id(node) in typing_only))
    return edges


def all_edges() -> list[ImportEdge]:
    return [e for p in modules() for e in import_edges(p)]


def test_every_module_belongs_to_a_known_layer() -> None:
    unknown = {module_name(p) for p in modules() if layer_of(module_name(p)) not in ALLOWED}
    assert not unknown, f"modules outside every layer: {sorted(unknown)}"


def test_imports_run_one_way() -> None:
    wrong = []
    for e in all_edges():
        src, dst = layer_of(e.module), layer_of(e.target)
        if src != dst and dst not in ALLOWED[src]:
            wrong.append(f"{e.module}:{e.line} ({src}) imports {e.target} ({dst})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_module_imports_the_package_root() -> None:
    wrong = [
        f"{e.module}:{e.line}"
        for e in all_edges()
        if e.target == "featbake" and layer_of(e.module) != "entry"
    ]
    assert not wrong, f"import featbake's submodules directly, not the root: {wrong}"


def test_no_private_name_crosses_a_module() -> None:
    wrong = [
        f"{e.module}:{e.line} imports {name} from {e.target}"
        for e in all_edges()
        for name in e.names
        if name.startswith("_") and not name.startswith("__") and e.target != e.module
    ]
    assert not wrong, "private names used from another module:\n" + "\n".join(wrong)


def function_lengths(path: Path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0]
            # a docstring says what the function does; it is not what makes it long
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                start = body[1].lineno if len(body) > 1 else node.end_lineno
            else:
                start = first.lineno
            out[f"{module_name(path)}:{node.name}"] = node.end_lineno - start + 1
    return out


def test_functions_stay_small() -> None:
    long = {
        name: n
        for p in modules()
        for name, n in function_lengths(p).items()
        if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS
    }
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_every_exception_is_still_needed() -> None:
    """An exception for a module or function that has since been split must be dropped."""
    lengths = {k: v for p in modules() for k, v in function_lengths(p).items()}
    stale = [n for n in LONG_FUNCTIONS if lengths.get(n, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"short now, drop their exceptions: {stale}"


def test_the_declared_python_floor_is_the_one_ci_tests() -> None:
    """``requires-python``'s minimum is what ruff targets and what CI runs the tests on.

    A floor below the tested Python is a promise nobody checks: 3.10 was declared while
    ``enum.StrEnum`` and ``hashlib.file_digest`` (3.11) made four commands fail to import there.
    """
    import os
    import re
    import sys
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    floor = re.fullmatch(r">=\s*3\.(\d+)", project["project"]["requires-python"])
    assert floor, "requires-python must be a plain '>=3.N' floor"
    minor = int(floor.group(1))
    assert project["tool"]["ruff"]["target-version"] == f"py3{minor}"
    assert sys.version_info[:2] >= (3, minor)
    if os.environ.get("CI") == "true":
        assert sys.version_info[:2] == (3, minor), "CI must test the declared minimum Python"


def import_graph() -> dict[str, set[str]]:
    """module -> the featbake modules it imports anywhere in its file (lazy imports included,
    type-only ones under ``if TYPE_CHECKING:`` not: they never run): ``from pkg import sub``
    counts as an edge to ``pkg.sub`` when that is a module."""
    mods = {module_name(p) for p in modules()}
    graph: dict[str, set[str]] = {}
    for e in all_edges():
        if e.typing_only:
            continue
        subs = {f"{e.target}.{n}" for n in e.names} & mods
        for target in subs or ({e.target} & mods):
            if target != e.module:
                graph.setdefault(e.module, set()).add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circle() -> None:
    """No module imports, even lazily, one that imports it back (encode/encoders <-> hf was the
    last: loading from a path now sits above both, in encode/loaders)."""
    cycles = [
        c for c in import_cycles(import_graph()) if c != ["featbake.cli", "featbake.cli.main"]
    ]
    assert not cycles, f"import circles: {cycles}"
    assert import_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_the_layout_is_a_pure_path_object() -> None:
    """``store/layout.py`` imports no store module but the name checks' and the listing's
    (``store/url``, ``store/files``), lazily or not: the shard, the catalog and every place
    import it, and a question it asked of them (``Layout.has_shard``, ``Layout.describe``)
    made the circle layout <-> shard. Those questions are the place's (``store/place.py``)."""
    store = {m for m in import_graph().get("featbake.store.layout", ()) if ".store." in m}
    assert store <= {"featbake.store.url", "featbake.store.files"}, sorted(store)
