"""The engine's packages import each other without a cycle (tests/import_graph.py says what counts): each
part can be read, tested and replaced alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import find_cycle, import_graph

ENGINE = Path(__file__).resolve().parents[2] / "engine"

pytestmark = pytest.mark.unit


def test_the_engine_has_no_import_cycle():
    graph = import_graph(ENGINE)
    assert len(graph) > 40 and sum(map(len, graph.values())) > 60  # the walk found the engine and its imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_engine_root_holds_only_packages_and_the_demo():
    loose = sorted(p.name for p in ENGINE.glob("*.py"))
    assert loose == ["__init__.py", "demo.py"]
