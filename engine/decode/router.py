"""Placing requests on decode instances by their load (docs/design.md section 8).

A decode step's time grows with the number of sequences it runs (token-wise work) and with the KV they
attend to (attention), and an instance's memory is its KV. So the KV-aware policy places a request on
the instance with the lowest weighted sum of its running requests and its KV after placement (as a
fraction of its capacity), each relative to the busiest instance's: both terms span [0, 1] across the
fleet, so the weights trade them evenly. (Relative to capacity alone, the KV term stayed small until
instances filled, and one extra request outweighed ~6,000 tokens of KV: the policy was least-requests.)
Round-robin and least-requests are there to measure it against.

    router = Router(RouterConfig(policy=KV_AWARE))
    instance = router.place([InstanceLoad(running=3, kv_tokens=9_000, kv_capacity=65_536), ...], prompt_tokens=2_000)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUND_ROBIN, LEAST_REQUESTS, KV_AWARE = "round_robin", "least_requests", "kv_aware"
POLICIES = (ROUND_ROBIN, LEAST_REQUESTS, KV_AWARE)


@dataclass(frozen=True)
class InstanceLoad:
    running: int  # sequences the instance decodes (and has queued)
    kv_tokens: int  # their total KV length
    kv_capacity: int  # the KV tokens the instance can hold


@dataclass(frozen=True)
class RouterConfig:
    policy: str = KV_AWARE
    request_weight: float = 0.5  # KV_AWARE: weight of running requests, normalised by the busiest instance's
    kv_weight: float = 0.5  # KV_AWARE: weight of KV after placement, normalised by the instance's capacity

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"RouterConfig: policy must be one of {POLICIES}, got {self.policy!r}")
        if self.request_weight < 0 or self.kv_weight < 0 or self.request_weight + self.kv_weight == 0:
            raise ValueError("RouterConfig: request_weight and kv_weight must be >= 0 and not both 0")


class Router:
    def __init__(self, config: RouterConfig = RouterConfig()) -> None:
        self.config = config
        self._next = 0  # round-robin position; also where ties start, so equal instances take turns

    def place(self, loads: Sequence[InstanceLoad], prompt_tokens: int) -> int:
        """The index of the instance in `loads` to place a request of `prompt_tokens` on.

        An instance whose KV cannot take the prompt is passed over while another can; if none can, the
        request goes where it would overflow least (it waits there for pages)."""
        if not loads:
            raise ValueError("Router.place: no decode instances to place on")
        if prompt_tokens < 0:
            raise ValueError(f"Router.place: prompt_tokens must be >= 0, got {prompt_tokens}")
        for load in loads:
            if load.running < 0 or load.kv_tokens < 0 or load.kv_capacity < 1:
                raise ValueError(f"Router.place: invalid instance load {load}")
        order = [(self._next + i) % len(loads) for i in range(len(loads))]  # ties: the rotation decides
        fits = [i for i in order if loads[i].kv_tokens + prompt_tokens <= loads[i].kv_capacity]
        if not fits:
            chosen = min(order, key=lambda i: (loads[i].kv_tokens + prompt_tokens) / loads[i].kv_capacity)
        elif self.config.policy == ROUND_ROBIN:
            chosen = fits[0]
        elif self.config.policy == LEAST_REQUESTS:
            chosen = min(fits, key=lambda i: loads[i].running)
        else:
            busiest = max(1, max(load.running for load in loads))
            used = [(load.kv_tokens + prompt_tokens) / load.kv_capacity for load in loads]  # after placement
            fullest = max(used) or 1.0
            c = self.config
            chosen = min(fits, key=lambda i: c.request_weight * loads[i].running / busiest
                         + c.kv_weight * used[i] / fullest)
        self._next = (chosen + 1) % len(loads)
        return chosen
