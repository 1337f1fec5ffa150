"""The DSpark schedule on hand-made survivals: flat and steep SPS, prefixes, a case worked by hand."""

from __future__ import annotations

import random

import pytest

from engine.speculative.profile import SpsProfile
from engine.speculative.schedule import prefix_survivals, schedule


def flat(b: int) -> float:
    return 100.0  # a GPU-like curve: B tokens cost one step whatever B


def steep(b: int) -> float:
    return 1.0 / (0.01 + 0.02 * b)  # a CPU-like curve: every token pays for the output head


def survivals(seed: int, requests: int = 8, gamma: int = 5) -> list[list[float]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(requests):
        a, row = 1.0, []
        for _ in range(rng.randrange(gamma + 1)):
            a *= rng.choice([rng.random(), 1.0, 0.0])  # ties (certain drafts) and dead ends among them
            row.append(a)
        rows.append(row)
    return rows


def test_hand_computed_case() -> None:
    # B=2: Θ = 2·10 = 20; admit 0.9 -> τ 2.9, B 3, Θ 26.1; admit 0.6 -> τ 3.5, B 4, Θ 28;
    # 0.5 would give τ 4.0 at B 5: Θ 20 < 28, so the choice stops there
    table = {2: 10.0, 3: 9.0, 4: 8.0, 5: 5.0}
    chosen = schedule([[0.9, 0.5], [0.6]], table.__getitem__)
    assert chosen.lengths == [1, 1]
    assert chosen.tokens == 4
    assert chosen.expected == pytest.approx(3.5)
    assert chosen.throughput == pytest.approx(28.0)


def test_flat_sps_admits_every_positive_survival() -> None:
    for seed in range(20):
        rows = survivals(seed)
        chosen = schedule(rows, flat)
        assert chosen.lengths == [sum(a > 0 for a in row) for row in rows]


def test_steep_sps_admits_fewer() -> None:
    total_flat = total_steep = 0
    for seed in range(20):
        rows = survivals(seed)
        flat_lengths, steep_lengths = schedule(rows, flat).lengths, schedule(rows, steep).lengths
        assert all(s <= f for s, f in zip(steep_lengths, flat_lengths))
        total_flat, total_steep = total_flat + sum(flat_lengths), total_steep + sum(steep_lengths)
    assert total_steep < total_flat / 2
    # on the steep curve a draft is worth verifying only where its survival pays for the longer step:
    # (τ + a)·SPS(B + 1) > τ·SPS(B)  <=>  a > τ·0.02 / (0.01 + 0.02·B)
    chosen = schedule([[0.9], [0.3]], steep)
    assert chosen.lengths == [1, 0]  # 0.9 > 2·0.02/0.05 = 0.8; then 0.3 < 2.9·0.02/0.07 ≈ 0.83


def test_admitted_drafts_form_prefixes_and_theta_never_falls() -> None:
    for seed in range(50):
        rows = survivals(seed, requests=16)
        for sps in (flat, steep, SpsProfile((1, 8, 32, 96), (0.02, 0.03, 0.08, 0.3)).sps):
            chosen = schedule(rows, sps)
            assert all(0 <= n <= len(row) for n, row in zip(chosen.lengths, rows))
            assert chosen.tokens == len(rows) + sum(chosen.lengths)
            clamped = [prefix_survivals(row) for row in rows]
            admitted = sum(sum(a[:n]) for a, n in zip(clamped, chosen.lengths))
            assert chosen.expected == pytest.approx(len(rows) + admitted)
            assert chosen.throughput >= len(rows) * sps(len(rows))
            # nothing left out beats what was taken: every unadmitted draft has survival <= every admitted one
            taken = [a for row, n in zip(clamped, chosen.lengths) for a in row[:n]]
            left = [a for row, n in zip(clamped, chosen.lengths) for a in row[n:]]
            if taken and left:
                assert min(taken) >= max(left)


def test_ties_and_unordered_input_still_give_prefixes() -> None:
    rows = [[0.5, 0.5, 0.5], [0.5, 0.5], [0.2, 0.7, 0.7]]  # the last is not non-increasing: clamped to 0.2s
    chosen = schedule(rows, flat)
    assert chosen.lengths == [3, 2, 3]
    assert prefix_survivals([0.2, 0.7, float("nan"), 0.1]) == [0.2, 0.2, 0.0, 0.0]
    assert prefix_survivals([1.5, -0.1]) == [1.0, 0.0]


def test_a_zero_survival_does_not_raise_theta_and_ends_the_choice() -> None:
    assert schedule([[0.0, 0.0], [0.0]], flat).lengths == [0, 0]
    assert schedule([], flat).lengths == []


def test_max_tokens_caps_the_step() -> None:
    rows = [[0.9] * 5 for _ in range(4)]
    chosen = schedule(rows, flat, max_tokens=10)
    assert chosen.tokens == 10 and sum(chosen.lengths) == 6


def test_a_step_in_sps_is_crossed_when_the_drafts_beyond_it_pay_for_it() -> None:
    # as measured on one CPU: 2 tokens cost 1.7x one, and 2 to 8 the same
    profile = SpsProfile((1, 2, 8), (0.091, 0.158, 0.158)).sps
    rows = [[0.69, 0.55, 0.45, 0.38, 0.3]]
    # the first draft alone: Θ = 1.69 / 0.158 = 10.7 < 1 / 0.091 = 11.0, so the early stop verifies nothing
    assert schedule(rows, profile, lookahead=False).lengths == [0]
    # all five: Θ = 3.37 / 0.158 = 21.3, the highest of any prefix
    chosen = schedule(rows, profile)
    assert chosen.lengths == [5] and chosen.throughput == pytest.approx(3.37 / 0.158)


def test_lookahead_agrees_with_the_early_stop_on_smooth_curves_and_never_does_worse() -> None:
    bumpy = SpsProfile((1, 2, 4, 8, 32), (0.05, 0.09, 0.09, 0.1, 0.2)).sps
    for seed in range(50):
        rows = survivals(seed, requests=12)
        for sps in (flat, steep):
            assert schedule(rows, sps).lengths == schedule(rows, sps, lookahead=False).lengths
        assert schedule(rows, bumpy).throughput >= schedule(rows, bumpy, lookahead=False).throughput
