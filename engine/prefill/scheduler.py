"""Planning a prefill step: chunks across waiting requests that fill a time budget.

Requests are served oldest first. Each gets the largest chunk the budget has left for it, by the
fitted cost model, so a long prompt's chunks shrink as its prefix grows (attention cost grows with L).
Chunks end on block boundaries where that leaves them non-empty, so every chunk completes blocks the
store can take. The oldest request always progresses, so every request finishes: nothing starves.
A step never exceeds the budget, except with one token of the oldest request alone, when even that
does not fit.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.prefill.cost import ChunkCost

Request = TypeVar("Request", bound=Hashable)  # what names a request: the plan gives it back with its chunk


@dataclass(frozen=True)
class Waiting(Generic[Request]):
    request: Request
    start: int  # tokens already in its KV (loaded or computed)
    remaining: int  # tokens still to compute


def plan_step(waiting: Sequence[Waiting[Request]], cost: ChunkCost, budget_s: float,
              block_tokens: int) -> list[tuple[Request, int]]:
    """(request, tokens) chunks for the next step, in the order given (oldest first)."""
    plan: list[tuple[Request, int]] = []
    left = budget_s
    for item in waiting:
        if item.remaining <= 0:
            continue
        x = min(cost.max_tokens(item.start, left), item.remaining)
        if x < item.remaining:
            aligned = x - (item.start + x) % block_tokens
            x = aligned if aligned > 0 else x
        if x <= 0:
            if plan:
                continue  # a younger request with a shorter prefix may still fit
            # The oldest request must progress though the budget cannot be kept. A step costs its overhead
            # whatever it computes (on a loaded machine the overhead alone can pass the budget), so it
            # goes to its next block boundary: one token per step would pay that overhead per token.
            x = min(item.remaining, block_tokens - item.start % block_tokens)
        plan.append((item.request, x))
        left -= cost.seconds(x, item.start)
    return plan


def step_seconds(plan: Sequence[tuple[Hashable, int]], starts: dict, cost: ChunkCost) -> float:
    """The cost model's estimate of a planned step."""
    return sum(cost.seconds(x, starts[request]) for request, x in plan)
