"""The planner on loads whose best balance is known, DeepSeek's own example, and random loads (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.experts.planner import contiguous_plan, imbalance, plan

pytestmark = pytest.mark.unit


def test_deepseeks_readme_example_is_reproduced():
    # github.com/deepseek-ai/EPLB README: 2 layers of 12 experts, 16 slots, 4 groups, 2 nodes, 8 GPUs (hierarchical)
    load = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                         [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    expected = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                             [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
    assert torch.equal(plan(load, 16, 4, 2, 8).slot_expert, expected)


def test_one_hot_expert_gets_the_redundant_slots_and_balance_becomes_perfect():
    # 300 tokens on expert 0, 100 on each other: three replicas of expert 0 make six slots of 100, three a device
    load = torch.tensor([[300, 100, 100, 100]])
    balanced = plan(load, 6, 1, 1, 2)
    assert balanced.replicas.tolist() == [[3, 1, 1, 1]]
    assert imbalance(balanced.device_loads(load)).item() == pytest.approx(1.0)
    assert imbalance(contiguous_plan(1, 4, 2).device_loads(load)).item() == pytest.approx(400 / 300)


def test_packing_without_replicas_reaches_the_known_optimum():
    # 6 experts on 3 devices, two each: 8 must share a device with one other, so the best busiest device is 8 + 1
    load = torch.tensor([[8, 4, 4, 2, 1, 1]])
    assert plan(load, 6, 1, 1, 3).device_loads(load).max().item() == pytest.approx(9)


def test_hierarchical_keeps_each_group_on_one_node():
    load = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
    placed = plan(load, 16, 4, 2, 8)  # 4 devices, 8 slots a node
    node_of_slot = torch.arange(16) // 8
    for group in range(4):
        nodes = {int(node_of_slot[s]) for s in range(16) if int(placed.slot_expert[0, s]) // 3 == group}
        assert len(nodes) == 1, f"group {group} spread over nodes {nodes}"


def test_groups_that_do_not_divide_nodes_fall_back_to_global():
    load = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]])
    assert torch.equal(plan(load, 16, 3, 2, 8).slot_expert, plan(load, 16, 1, 1, 8).slot_expert)


@pytest.mark.parametrize("slots, groups, nodes, devices", [(10, 1, 1, 4), (12, 5, 1, 4), (12, 1, 3, 4), (8, 1, 1, 4)])
def test_impossible_shapes_are_refused(slots, groups, nodes, devices):
    with pytest.raises(ValueError):
        plan(torch.ones(1, 12), slots, groups, nodes, devices)


@st.composite
def shapes(draw):
    devices = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.sampled_from([n for n in (1, 2, 4) if devices % n == 0]))
    experts = devices * draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in range(1, experts + 1) if experts % g == 0]))
    slots = experts + devices * draw(st.integers(0, 2))
    layers = draw(st.integers(1, 3))
    load = torch.tensor(draw(st.lists(st.integers(0, 10_000), min_size=layers * experts,
                                      max_size=layers * experts))).view(layers, experts)
    skew = draw(st.sampled_from([1, 2, 3]))  # squaring and cubing make a few experts dominate
    return load.double() ** skew, slots, groups, nodes, devices


@settings(max_examples=150, deadline=None)
@given(shapes())
def test_plans_of_random_loads_are_complete_and_never_worse_than_plain_expert_parallelism(case):
    load, slots, groups, nodes, devices = case
    layers, experts = load.shape
    placed = plan(load, slots, groups, nodes, devices)
    assert placed.slot_expert.shape == (layers, slots)
    assert (placed.replicas >= 1).all(), "every expert has a replica"
    assert (placed.replicas.sum(1) == slots).all(), "replica counts add up to the slots"
    for layer in range(layers):  # the counts are the map's
        assert torch.equal(torch.bincount(placed.slot_expert[layer], minlength=experts), placed.replicas[layer])
    per_device = placed.device_loads(load)  # each device holds slots / devices slots by layout; their loads sum up
    assert torch.allclose(per_device.sum(1), load.sum(1))
    plain = contiguous_plan(layers, experts, devices).device_loads(load)
    assert (per_device.amax(1) <= plain.amax(1) * (1 + 1e-9)).all()
    assert torch.equal(plan(load, slots, groups, nodes, devices).slot_expert, placed.slot_expert), "deterministic"
