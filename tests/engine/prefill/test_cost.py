from __future__ import annotations

import random

import pytest

from engine.prefill.cost import ChunkCost, fit

pytestmark = pytest.mark.unit


def test_fit_recovers_known_coefficients():
    truth = ChunkCost(a=2e-8, b=3e-5, c=1e-3)
    rng = random.Random(0)
    samples = [(x, start, truth.seconds(x, start) * (1 + rng.uniform(-0.01, 0.01)))
               for x in (16, 64, 256, 1024) for start in (0, 512, 4096)]
    fitted = fit(samples)
    assert fitted.a == pytest.approx(truth.a, rel=0.05)
    assert fitted.b == pytest.approx(truth.b, rel=0.05)
    assert fitted.c == pytest.approx(truth.c, rel=0.2)


def test_fit_keeps_coefficients_non_negative():
    # timings with no per-chunk overhead and noise that would pull c below zero
    samples = [(x, 0, 1e-5 * x - (2e-4 if x == 8 else 0)) for x in (8, 64, 512)]
    fitted = fit(samples)
    assert min(fitted.a, fitted.b, fitted.c) >= 0 and fitted.b > 0
    with pytest.raises(ValueError):
        fit(samples[:2])


@pytest.mark.parametrize("start", [0, 100, 10_000])
def test_max_tokens_is_the_largest_chunk_within_the_budget(start):
    cost = ChunkCost(a=1e-8, b=1e-5, c=1e-4)
    for budget in (1e-5, 1e-3, 0.01, 0.5):
        x = cost.max_tokens(start, budget)
        assert x == 0 or cost.seconds(x, start) <= budget
        assert cost.seconds(x + 1, start) > budget


def test_engine_fits_its_cost_on_this_machine(tiny_models):
    from engine.prefill.config import PrefillConfig
    from engine.prefill.engine import PrefillEngine

    engine = PrefillEngine.from_pretrained(tiny_models["qwen3"].path, None, PrefillConfig(block_tokens=16, kv_pages=64))
    assert engine.cost.a + engine.cost.b > 0
    assert engine.cost.seconds(256, 0) > engine.cost.seconds(16, 0)
    assert engine.pool.free_pages == 64  # measuring gave back every page
