"""The import graph of harnessrl's modules has no cycle: every import counts (module level, inside a
function, under `TYPE_CHECKING`), since each one mirrors a dependency of the code. And the top level of
the package holds only entry points, shared leaves and packages."""

from __future__ import annotations

import ast
from pathlib import Path

import harnessrl

ROOT = Path(harnessrl.__file__).parent
# Modules allowed at the top of src/harnessrl: entry points (cli, api) and shared leaves.
TOP_LEVEL_MODULES = {"__init__", "api", "cli", "defaults", "errors", "schema"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        if "templates" in path.parts or "examples" in path.relative_to(ROOT).parts[1:2]:
            continue
        found[_module_name(path)] = path
    return found


def _targets(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The harnessrl modules one import statement names (a name imported from a package counts as
    its submodule when there is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in known else base)
    return [t for t in out if t in known]


def import_graph() -> dict[str, set[str]]:
    """module -> the harnessrl modules it imports (explicitly; a parent package's __init__ is not an
    edge of its own)."""
    modules = _modules()
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        edges = {t for node in ast.walk(tree) for t in _targets(node, name, is_package, known)}
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (as a path that returns to its start), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_top_level_holds_entry_points_shared_leaves_and_packages() -> None:
    modules = {p.stem for p in ROOT.glob("*.py")}
    assert modules == TOP_LEVEL_MODULES, sorted(modules ^ TOP_LEVEL_MODULES)
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert "runs" in packages and "services" in packages and "inspect" not in packages
