"""Placing requests on decode instances: the KV-aware policy beside round-robin and least-requests."""

from __future__ import annotations

import pytest

from engine.decode.router import KV_AWARE, LEAST_REQUESTS, ROUND_ROBIN, InstanceLoad, Router, RouterConfig

pytestmark = pytest.mark.unit
CAPACITY = 10_000


def _loads(*pairs: tuple[int, int]) -> list[InstanceLoad]:
    return [InstanceLoad(running, kv, CAPACITY) for running, kv in pairs]


def test_round_robin_takes_turns_whatever_the_load():
    router = Router(RouterConfig(policy=ROUND_ROBIN))
    loads = _loads((9, 9_000), (0, 0), (0, 0))
    assert [router.place(loads, 10) for _ in range(4)] == [0, 1, 2, 0]


def test_least_requests_ignores_kv_length():
    router = Router(RouterConfig(policy=LEAST_REQUESTS))
    assert router.place(_loads((2, 100), (1, 8_000)), 10) == 1


def test_kv_aware_weighs_kv_length_beside_requests():
    router = Router(RouterConfig(policy=KV_AWARE))
    # one long sequence against two short ones: the long one's KV outweighs one extra request
    assert router.place(_loads((2, 200), (1, 8_000)), 100) == 0
    # with only requests weighed it agrees with least-requests
    assert Router(RouterConfig(request_weight=1, kv_weight=0)).place(_loads((2, 200), (1, 8_000)), 100) == 1


def test_kv_aware_counts_the_request_it_places():
    router = Router(RouterConfig(policy=KV_AWARE, request_weight=0, kv_weight=1))
    loads = [InstanceLoad(0, 0, 1_000), InstanceLoad(0, 500, 100_000)]
    assert router.place(loads, 900) == 1  # 900/1,000 of the small one against 1,400/100,000 of the large one


def test_ties_rotate_so_equal_instances_share_the_work():
    router = Router()
    loads = _loads((0, 0), (0, 0), (0, 0))
    assert sorted(router.place(loads, 10) for _ in range(3)) == [0, 1, 2]


def test_an_instance_that_cannot_hold_the_prompt_is_passed_over():
    for policy in (ROUND_ROBIN, LEAST_REQUESTS, KV_AWARE):
        router = Router(RouterConfig(policy=policy))
        assert router.place(_loads((0, 9_990), (5, 1_000)), 50) == 1
    # none can: the one it would overflow least, where it waits for pages
    assert Router().place(_loads((0, 9_990), (0, 9_900)), 500) == 1


@pytest.mark.parametrize("config, message", [
    ({"policy": "random"}, "policy must be one of"),
    ({"request_weight": -1}, "must be >= 0"),
    ({"request_weight": 0, "kv_weight": 0}, "not both 0"),
])
def test_bad_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**config)


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="no decode instances"):
        Router().place([], 10)
    with pytest.raises(ValueError, match="prompt_tokens"):
        Router().place(_loads((0, 0)), -1)
    with pytest.raises(ValueError, match="invalid instance load"):
        Router().place([InstanceLoad(0, 0, 0)], 10)


def test_kv_aware_weighs_kv_far_from_capacity_too():
    """Both terms are relative to the busiest instance: far from capacity, 6,000 tokens of KV still count
    against one extra short request (relative to capacity alone they were 6% of it, and lost)."""
    loads = [InstanceLoad(1, 6_000, 100_000), InstanceLoad(2, 100, 100_000)]
    assert Router(RouterConfig(policy=KV_AWARE)).place(loads, 50) == 1
    assert Router(RouterConfig(policy=LEAST_REQUESTS)).place(loads, 50) == 0
