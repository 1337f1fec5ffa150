"""kvstore/ imports itself without a cycle (tests/import_graph.py says what counts as an import): any module
can be imported first, and a reader can follow the layers downwards."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.import_graph import find_cycle, import_graph

pytestmark = pytest.mark.unit

KVSTORE = Path(__file__).resolve().parents[2] / "kvstore"


def test_kvstore_has_no_import_cycle():
    graph = import_graph(KVSTORE)
    assert len(graph) > 50 and "kvstore.server.segments" in graph["kvstore.server.store"], \
        "the walk must see the package and its imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
