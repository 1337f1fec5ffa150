from __future__ import annotations

import random

import pytest

from engine.prefill.cost import ChunkCost
from engine.prefill.scheduler import Waiting, plan_step

pytestmark = pytest.mark.unit

COST = ChunkCost(a=2e-8, b=2e-5, c=5e-4)


def _simulate(prompts: list[int], budget: float, block: int, arrivals: dict[int, list[int]] | None = None):
    """Run plans step by step until every request is done; the plans and each request's chunk sizes."""
    arrivals = arrivals or {}
    progress = {i: 0 for i in range(len(prompts))}
    active = [i for i in range(len(prompts)) if not any(i in later for later in arrivals.values())]
    plans, chunks = [], {i: [] for i in progress}
    step = 0
    while active or any(k >= step for k in arrivals):
        active += arrivals.get(step, [])
        waiting = [Waiting(i, progress[i], prompts[i] - progress[i]) for i in active]
        plan = plan_step(waiting, COST, budget, block)
        starts = {i: progress[i] for i in active}
        plans.append((plan, starts))
        for request, x in plan:
            progress[request] += x
            chunks[request].append(x)
        active = [i for i in active if progress[i] < prompts[i]]
        step += 1
        assert step < 100_000, "a request starved"
    return plans, chunks, progress


@pytest.mark.parametrize("seed", range(5))
def test_no_step_exceeds_the_budget_and_every_request_finishes(seed):
    rng = random.Random(seed)
    prompts = [rng.randint(1, 20_000) for _ in range(12)]
    arrivals = {rng.randint(1, 30): [i] for i in range(6, 12)}
    budget = rng.choice([0.005, 0.05, 0.5])
    plans, _, progress = _simulate(prompts, budget, 64, arrivals)
    assert progress == dict(enumerate(prompts))
    for plan, starts in plans:
        estimate = sum(COST.seconds(x, starts[r]) for r, x in plan)
        assert estimate <= budget * (1 + 1e-9) or plan == [(plan[0][0], 1)]


def test_a_long_prompt_is_cut_into_chunks_that_shrink_and_end_on_blocks():
    _, chunks, _ = _simulate([60_000], 0.2, 64)
    sizes = chunks[0]
    assert len(sizes) > 3
    assert all(a >= b for a, b in zip(sizes, sizes[1:-1]))  # shrinking as the prefix grows
    assert sizes[0] > 2 * sizes[-2]
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
    assert all(end % 64 == 0 for end in ends)


def test_oldest_first_and_younger_fill_the_rest():
    waiting = [Waiting("old", 0, 300), Waiting("young", 0, 10_000)]
    plan = plan_step(waiting, COST, 0.05, 64)
    assert plan[0] == ("old", 300) and plan[1][0] == "young" and plan[1][1] > 0


def test_the_oldest_goes_to_its_next_block_boundary_when_nothing_fits():
    huge = ChunkCost(a=0, b=1.0, c=0)
    assert plan_step([Waiting("a", 0, 10), Waiting("b", 0, 10)], huge, 0.5, 4) == [("a", 4)]
    assert plan_step([Waiting("a", 6, 10)], huge, 0.5, 4) == [("a", 2)]
    assert plan_step([Waiting("a", 6, 1)], huge, 0.5, 4) == [("a", 1)]
    overhead = ChunkCost(a=0, b=1e-6, c=1.0)  # the step's overhead alone passes the budget
    assert plan_step([Waiting("a", 0, 2000)], overhead, 0.25, 256) == [("a", 256)]
