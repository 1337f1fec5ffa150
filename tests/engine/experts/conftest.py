"""The `experts` marker: multi-process gloo tests, run by `make test-experts`, left out of `make test`.

Registered here rather than in pyproject.toml's marker list so this package stays self-contained: tests marked
`experts` are deselected unless the `-m` expression names them.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "experts: expert parallelism across spawned gloo ranks (make test-experts)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "experts" in (config.getoption("markexpr") or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("experts")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("experts")]
