"""kvstore/ has no import cycle: a module's import-time dependencies form a DAG, so any module can be
imported first and a reader can follow the layers downwards. Imports inside functions and under
`if TYPE_CHECKING:` do not run at import time and are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvstore"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_time_imports(path: Path, modules: set[str]) -> set[str]:
    """The kvstore modules `path` imports when it is imported (and the packages they live in)."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found.update(f"{base}.{alias.name}" for alias in node.names)

    visit(tree.body)
    ancestors = {".".join(here.split(".")[:i]) for i in range(1, here.count(".") + 1)}
    edges = set()
    for name in found:
        target = name if name in modules else name.rpartition(".")[0]  # a module, or a name from one
        if target not in modules:
            continue
        parts = target.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a, a.b and a.b.c
            prefix = ".".join(parts[:i])
            # The packages this module lives in are being imported already when it runs: no edge to
            # them, unless it takes names from one.
            if prefix != here and (prefix not in ancestors or prefix == target):
                edges.add(prefix)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := walk(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)):
            return cycle
    return None


def kvstore_graph() -> dict[str, set[str]]:
    files = [p for p in PACKAGE.rglob("*.py") if "proto" not in p.relative_to(PACKAGE).parts]
    modules = {module_name(p) for p in files}
    return {module_name(p): import_time_imports(p, modules) for p in files}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kvstore_has_no_import_cycle():
    graph = kvstore_graph()
    assert len(graph) > 50 and graph["kvstore.server.store"], "the graph must see the package's imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
