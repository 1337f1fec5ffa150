"""Load statistics: the sliding window forgets old steps; the metrics say what was counted."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from engine.experts.planner import contiguous_plan
from engine.experts.stats import LoadStats

pytestmark = pytest.mark.unit


def test_window_keeps_only_the_latest_steps():
    stats = LoadStats(layers=2, experts=4, window=2)
    stats.record(0, torch.tensor([[0, 1], [0, 2]]))  # step 0
    stats.end_step()
    stats.record(0, torch.tensor([[3, 1]]))  # step 1
    stats.record(1, torch.tensor([[2, 2]]))
    assert stats.window_load().tolist() == [[2, 2, 1, 1], [0, 0, 2, 0]]
    stats.end_step()
    stats.record(0, torch.tensor([[3, 3]]))  # step 2: step 0 leaves the window
    assert stats.window_load().tolist() == [[0, 1, 0, 3], [0, 0, 2, 0]]
    assert stats.total().tolist() == [[2, 2, 1, 3], [0, 0, 2, 0]]


def test_metrics_export_counts_and_imbalance():
    stats = LoadStats(layers=1, experts=4, window=8)
    stats.record(0, torch.tensor([[0, 1], [0, 1], [0, 2]]))

    class Collector:
        def collect(self):
            return stats.metrics(contiguous_plan(1, 4, 2).device_loads(stats.window_load()))

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    assert 'engine_expert_tokens_total{expert="0",layer="0"} 3.0' in text
    assert 'engine_expert_window_tokens{expert="2",layer="0"} 1.0' in text
    assert 'engine_expert_device_imbalance{layer="0"} 1.6666666666666667' in text  # devices 5 and 1 tokens


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        LoadStats(1, 4, window=0)
