"""The cost of computing a chunk, fitted on the machine the engine runs on.

A chunk of x new tokens after L cached or computed ones costs about

    t(x, L) = a·x·(2L + x) + b·x + c

a: attention (each new token reads the L earlier ones and, causally, half the chunk: x·L + x²/2
pairs, so x·(2L + x)/2 up to a constant folded into a); b: everything per token (projections, MLP);
c: per-chunk overhead. Fitted by least squares over timed forwards at start-up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChunkCost:
    a: float  # s per attention pair unit
    b: float  # s per token
    c: float  # s per chunk

    def __post_init__(self) -> None:
        if min(self.a, self.b, self.c) < 0 or self.a + self.b <= 0:
            raise ValueError(f"a chunk cost model needs non-negative coefficients, some positive: {self}")

    def seconds(self, x: int, start: int) -> float:
        """Estimated time of x new tokens after `start` earlier ones (0 for no tokens)."""
        return self.a * x * (2 * start + x) + self.b * x + self.c if x > 0 else 0.0

    def prefill_seconds(self, begin: int, end: int) -> float:
        """Computing tokens [begin, end) in one chunk with [0, begin) in place (the client's compute_s)."""
        return self.seconds(end - begin, begin)

    def max_tokens(self, start: int, budget_s: float) -> int:
        """The most tokens one chunk after `start` can take within `budget_s` (0 if not even one)."""
        room = budget_s - self.c
        if room <= 0:
            return 0
        linear = 2 * self.a * start + self.b
        if self.a == 0:
            return int(room / linear)
        x = (-linear + math.sqrt(linear * linear + 4 * self.a * room)) / (2 * self.a)
        x = int(x)
        while x > 0 and self.seconds(x, start) > budget_s:  # floating point at the edge
            x -= 1
        return x


def fit(samples: Sequence[tuple[int, int, float]]) -> ChunkCost:
    """Least squares over (x, L, seconds) samples, coefficients held non-negative."""
    if len(samples) < 3:
        raise ValueError("fitting a chunk cost needs at least three timed chunks")
    x = np.array([s[0] for s in samples], dtype=float)
    start = np.array([s[1] for s in samples], dtype=float)
    seconds = np.array([s[2] for s in samples], dtype=float)
    features = np.stack([x * (2 * start + x), x, np.ones_like(x)], axis=1)  # (samples, 3)
    active = [0, 1, 2]
    while True:  # drop any coefficient that comes out negative and refit (a tiny active-set NNLS)
        solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
        if (solution >= 0).all() or len(active) == 1:
            break
        active.pop(int(np.argmin(solution)))
    coefficients = [0.0, 0.0, 0.0]
    for index, value in zip(active, solution):
        coefficients[index] = max(float(value), 0.0)
    if coefficients[0] + coefficients[1] <= 0:
        coefficients[1] = float(seconds.sum() / x.sum())
    return ChunkCost(*coefficients)


def measure(run_chunk: Callable[[int, int], None], grid: Sequence[tuple[int, int]], repeats: int = 3) -> ChunkCost:
    """Time `run_chunk(x, L)` over a grid of (x, L), best of `repeats` each, and fit."""
    samples = []
    for x, start in grid:
        best = math.inf
        for _ in range(repeats):
            began = time.perf_counter()
            run_chunk(x, start)
            best = min(best, time.perf_counter() - began)
        samples.append((x, start, best))
    return fit(samples)
