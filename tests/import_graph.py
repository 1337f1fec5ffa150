"""The import graph of one of the project's packages, for the tests that keep it free of cycles.

Every import counts, at module level or inside a function, since either can close a loop at run time;
imports under `if TYPE_CHECKING:` never run and do not. Importing `a.b.c` also runs the package `a.b`'s
__init__; those implicit edges are not counted, as a package importing its own modules is what a package
is, but taking a name from a package (`from a.b import name`) is an edge to its __init__."""

from __future__ import annotations

import ast
from pathlib import Path


def modules_of(package: Path) -> dict[str, Path]:
    """Module name -> file, for every module of `package` (generated protobuf code left out)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if "proto" not in parts:
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_nodes(tree: ast.AST):
    """Every import statement, skipping the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `path` (module `name`) imports, by name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        for alias in node.names:  # `from pkg import module` imports the module; `from pkg import name`, pkg
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = modules_of(package)
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as a path that ends where it starts; None if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None
