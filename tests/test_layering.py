"""The import floors: cpu_kernels at the bottom, placement above it, hybrid above both, bench on top.

A module may import from its own floor or a lower one, never a higher one, and no group of modules (nor of
hybrid's packages) may import each other in a cycle. Every import statement counts, including those inside functions (a deferred import is
still a dependency); only `if TYPE_CHECKING:` blocks are left out, since they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ("cpu_kernels", "placement", "hybrid", "bench")  # lowest first


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the floors (a package is its __init__.py)."""
    out = {}
    for floor in FLOORS:
        for path in sorted((root / floor).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _runs(tree: ast.AST):
    """The nodes of `tree` outside `if TYPE_CHECKING:` blocks."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return (n for n in ast.walk(tree) if id(n) not in skipped)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` imports: `from pkg import sub` names the submodule when there is one,
    else the package; an unknown dotted name resolves to its nearest known parent."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def known(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    targets = []
    for node in _runs(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return {t for t in map(known, targets) if t and t != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def floor_of(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if floor_of(b) > floor_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Groups of two or more modules that reach each other (strongly connected components, Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:  # recursion depth is bounded by the module count (a few hundred)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe(graph, group):
    inside = set(group)
    return "; ".join(f"{a} -> {b}" for a in group for b in sorted(graph[a] & inside))


def test_no_floor_imports_a_higher_one():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    graph = import_graph()
    assert [_describe(graph, g) for g in cycles(graph)] == []


def test_no_cycles_between_packages():
    """One level coarser: hybrid's packages (runtime, offload, loading, server, ...) import each other one way
    only, so that, say, opening a model (hybrid.loading) sits above both the runtime and the offload."""
    graph: dict[str, set[str]] = {}
    for a, deps in import_graph().items():
        graph.setdefault(_package(a), set()).update(_package(b) for b in deps if _package(b) != _package(a))
    for deps in list(graph.values()):
        for b in deps:
            graph.setdefault(b, set())
    assert [_describe(graph, g) for g in cycles(graph)] == []


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_the_checks_catch_what_they_guard(tmp_path):
    """The graph sees imports inside functions and relative ones, and both checks fire on a planted case."""
    for floor in FLOORS:
        (tmp_path / floor).mkdir()
        (tmp_path / floor / "__init__.py").write_text("")
    (tmp_path / "placement" / "a.py").write_text("def f():\n    from hybrid import errors\n")
    (tmp_path / "hybrid" / "errors.py").write_text("from . import b\n")
    (tmp_path / "hybrid" / "b.py").write_text("import hybrid.errors\n")
    (tmp_path / "cpu_kernels" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from placement import a\n")
    graph = import_graph(tmp_path)
    assert upward_imports(graph) == ["placement.a -> hybrid.errors"]
    assert cycles(graph) == [["hybrid.b", "hybrid.errors"]]
