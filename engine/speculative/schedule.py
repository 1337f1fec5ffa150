"""The DSpark verification schedule: how many drafts of each request to verify this step.

For R requests with prefix survivals a_{r,1..γ_r} (a_{r,j}: the calibrated probability that drafts 1..j
of request r are all accepted), verifying ℓ_r drafts of each costs one forward of

    B = Σ_r (1 + ℓ_r) tokens                      (each request also scores its last real token)

and is expected to yield τ = Σ_r (1 + Σ_{j ≤ ℓ_r} a_{r,j}) tokens (the target's own token always comes).
Throughput is Θ = τ · SPS(B), SPS being target forward steps per second at B tokens. Greedily: sort all
(r, j) by a_{r,j}, highest first; from ℓ = 0, admit candidates in that order while Θ rises and stop at the
first that does not (DSpark's early stop), or, by default here, take the prefix of that order with the
highest Θ (the same choice on a smooth SPS curve, a better one where SPS has steps: see `schedule`).
The choice reads only survivals, never a token not yet sampled, which keeps it lossless. Since
a_{r,j} ≤ a_{r,j-1} (a product of factors ≤ 1), admitted drafts of a request form a prefix; ties are
ordered by j, and survivals are clamped non-increasing, so that holds exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Sps = Callable[[int], float]  # B tokens -> target forward steps per second


@dataclass(frozen=True)
class Schedule:
    lengths: list[int]  # ℓ_r: drafts to verify of each request
    tokens: int  # B
    expected: float  # τ
    throughput: float  # Θ = τ · SPS(B), expected tokens per second


def prefix_survivals(survivals: Sequence[float]) -> list[float]:
    """The survivals clamped to [0, 1] and non-increasing in j (a guard: a product of probabilities is)."""
    out, low = [], 1.0
    for a in survivals:
        if a != a:  # NaN: nothing after it can be trusted
            a = 0.0
        low = min(low, max(0.0, float(a)))
        out.append(low)
    return out


def schedule(survivals: Sequence[Sequence[float]], sps: Sps, max_tokens: int | None = None,
             lookahead: bool = True) -> Schedule:
    """ℓ_r for each request by the DSpark greedy order; `max_tokens` optionally caps B (e.g. KV room).

    The candidates are taken in DSpark's order, highest survival first. With `lookahead` the choice is the
    prefix of that order with the highest Θ; without, the first candidate that does not raise Θ ends it
    (the paper's early stop). The two agree wherever Θ along the order rises then falls, as it does on a
    smooth SPS curve; where SPS(B) has a step (on one CPU here a forward of 2 tokens took 1.7x one of 1,
    and 2 to 8 cost the same), the early stop refuses the first draft, which does not pay for the step
    alone, although five drafts would. Either way the choice reads only survivals and SPS."""
    a = [prefix_survivals(row) for row in survivals]
    if not a:
        return Schedule([], 0, 0.0, 0.0)
    # highest survival first; equal survivals by position j, then request, so a request's j comes before j+1
    candidates = sorted(((a[r][j], j, r) for r in range(len(a)) for j in range(len(a[r]))),
                        key=lambda c: (-c[0], c[1], c[2]))
    tokens, expected = len(a), float(len(a))
    best = (expected * sps(tokens), 0, expected)  # Θ, candidates taken, τ of the best prefix so far
    for count, (value, _, _) in enumerate(candidates, 1):
        if max_tokens is not None and tokens + 1 > max_tokens:
            break
        tokens += 1
        expected += value
        throughput = expected * sps(tokens)
        if throughput > best[0]:
            best = (throughput, count, expected)
        elif not lookahead:  # the first candidate that does not raise Θ ends the step's choice
            break
    throughput, taken, expected = best
    lengths = [0] * len(a)
    for _, j, r in candidates[:taken]:
        assert j == lengths[r], "survivals sorted by value then position admit each request's drafts in order"
        lengths[r] += 1
    return Schedule(lengths, len(a) + taken, expected, throughput)
