"""Tokens routed to each expert, per MoE layer, over a sliding window of steps: what the planner balances.

Always on, so it must be cheap: a step adds one `bincount` per MoE layer into a ring of `window` rows; the
window's sum is only computed when read (a rebalance, a scrape). Counts stay on the model's device, so a
GPU step never waits for them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from engine.experts.planner import imbalance


class LoadStats:
    def __init__(self, layers: int, experts: int, window: int, device: torch.device | str = "cpu") -> None:
        """Counts for `layers` MoE layers of `experts` experts each, over the latest `window` steps."""
        if window < 1:
            raise ValueError(f"LoadStats: window must be >= 1 step, got {window}")
        self.layers, self.experts, self.window = layers, experts, window
        self._ring = torch.zeros(window, layers, experts, dtype=torch.int64, device=device)  # (window, layers, experts)
        self._total = torch.zeros(layers, experts, dtype=torch.int64, device=device)  # since start, for counters
        self.steps = 0  # steps ended (`end_step`)

    def record(self, layer: int, chosen: torch.Tensor) -> None:
        """Add the step's routing of MoE layer `layer`: chosen (tokens, top_k) logical expert ids."""
        counts = torch.bincount(chosen.reshape(-1), minlength=self.experts)  # (experts,)
        self._ring[self.steps % self.window, layer] += counts
        self._total[layer] += counts

    def end_step(self) -> None:
        """Close the current step: the next one overwrites the window's oldest row."""
        self.steps += 1
        self._ring[self.steps % self.window].zero_()

    def window_load(self) -> torch.Tensor:
        """Tokens per expert over the window (layers, experts) int64: the current step's and the `window` - 1
        before it."""
        return self._ring.sum(0)

    def total(self) -> torch.Tensor:
        """Tokens per expert since start (layers, experts) int64."""
        return self._total.clone()

    def metrics(self, plan_device_loads: torch.Tensor | None = None) -> Iterator[Metric]:
        """Prometheus families: tokens per expert since start (a counter) and over the window (a gauge); with the
        window's tokens per device (layers, devices) from `Plan.device_loads`, max/mean per layer too. Register
        with `registry.register(collector)` where `collector.collect` returns this."""
        total = CounterMetricFamily("engine_expert_tokens", "Tokens routed to each expert since start",
                                    labels=["layer", "expert"])
        window = GaugeMetricFamily("engine_expert_window_tokens", f"Tokens routed to each expert over the latest "
                                   f"{self.window} steps", labels=["layer", "expert"])
        for layer, (row_total, row_window) in enumerate(zip(self._total.tolist(), self.window_load().tolist())):
            for expert, (t, w) in enumerate(zip(row_total, row_window)):
                total.add_metric([str(layer), str(expert)], t)
                window.add_metric([str(layer), str(expert)], w)
        yield total
        yield window
        if plan_device_loads is not None:
            ratio = GaugeMetricFamily("engine_expert_device_imbalance", "max / mean tokens per device over the "
                                      "window", labels=["layer"])
            for layer, value in enumerate(imbalance(plan_device_loads).tolist()):
                ratio.add_metric([str(layer)], value)
            yield ratio
