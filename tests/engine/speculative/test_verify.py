"""The acceptance rules: greedy matches the argmax rule; rejection sampling reproduces the target's distribution,
and with a deterministic drafter (drawing the target's own tokens) even the plain sampler's seeded tokens."""

from __future__ import annotations

import itertools
import math

import torch

from engine.speculative.verify import residual, verify_drawn, verify_greedy, verify_sampled

V = 3  # a small vocabulary, so every sequence of L tokens is a cell with many samples
L = 3  # tokens per sampled sequence
TRIALS = 20_000
ALPHA = 1e-3  # the test's false-alarm rate
Z = 3.0902  # the standard normal's (1 - ALPHA) quantile


def chi_square_limit(df: int, z: float = Z) -> float:
    """The chi-square (1 - ALPHA) quantile, by Wilson-Hilferty: exact enough for df >= 3."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def test_greedy_accepts_the_run_of_argmax_matches_then_the_targets_token() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0],   # argmax 1
                           [3.0, 0.0, 1.0, 0.0],   # argmax 0
                           [0.0, 0.0, 0.0, 9.0],   # argmax 3
                           [0.0, 2.0, 0.0, 0.0]])  # argmax 1
    assert verify_greedy(torch.tensor([1, 0, 3]), logits).tokens == [1, 0, 3, 1]  # all accepted, then a bonus
    partial = verify_greedy(torch.tensor([1, 2, 3]), logits)
    assert (partial.accepted, partial.tokens) == (1, [1, 0])  # the second draft loses to the argmax 0
    # a later match after a mismatch counts for nothing: acceptance stops at the first mismatch
    assert verify_greedy(torch.tensor([2, 0, 3]), logits[:4]).tokens == [1]
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]).tokens == [1]  # no drafts: plain decoding


def markov_target(seed: int) -> torch.Tensor:
    """P[prev] (V + 1, V): the target's next-token distribution after token prev (row V: the start), every
    entry at least 1/(2V) so every cell of V**L is well filled."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.rand(V + 1, V, generator=generator, dtype=torch.float64)
    return 0.5 / V + 0.5 * noise / noise.sum(-1, keepdim=True)


def draft_of(prev: int) -> int:
    return (prev + 1) % V if prev < V else 0  # a deterministic drafter, right only sometimes


def sample_sequences(P: torch.Tensor, generator: torch.Generator, rule: str = "rejection") -> torch.Tensor:
    """TRIALS sequences of L tokens, decoded speculatively with 2 drafts a step; counts per cell (V**L,)."""
    counts = torch.zeros(V**L, dtype=torch.long)
    for _ in range(TRIALS):
        out: list[int] = []
        while len(out) < L:
            last = out[-1] if out else V
            drafts = [draft_of(last)]
            drafts.append(draft_of(drafts[-1]))
            probs = P[[last, *drafts]]  # (3, V): the target's rows after last, after draft 1, after draft 2
            if rule == "naive":
                out += naive_verify(torch.tensor(drafts), probs, generator)
            elif rule == "drawn":
                out += verify_drawn(drafts, lambda i: int(torch.multinomial(probs[i], 1, generator=generator))).tokens
            else:
                out += verify_sampled(torch.tensor(drafts), probs, generator).tokens
        counts[sum(t * V**i for i, t in enumerate(out[:L]))] += 1
    return counts


def naive_verify(drafts: torch.Tensor, probs: torch.Tensor, generator: torch.Generator) -> list[int]:
    """A wrong rule, to show the test can fail: on rejection, draw from p itself instead of the residual."""
    for i, d in enumerate(drafts.tolist()):
        if float(torch.rand(1, generator=generator, dtype=probs.dtype)) >= float(probs[i, d]):
            return drafts[:i].tolist() + [int(torch.multinomial(probs[i], 1, generator=generator))]
    return drafts.tolist() + [int(torch.multinomial(probs[-1], 1, generator=generator))]


def exact(P: torch.Tensor) -> torch.Tensor:
    """The target's own probability of each cell (V**L,): the product of its conditionals."""
    probs = torch.zeros(V**L, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=L):
        p, last = 1.0, V
        for t in seq:
            p, last = p * float(P[last, t]), t
        probs[sum(t * V**i for i, t in enumerate(seq))] = p
    return probs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_speculative_sampling_reproduces_the_targets_distribution() -> None:
    P = markov_target(0)
    probs = exact(P)
    limit = chi_square_limit(V**L - 1)
    counts = sample_sequences(P, torch.Generator().manual_seed(1))
    assert chi_square(counts, probs) < limit
    # the same test catches a rule that is not lossless
    wrong = sample_sequences(P, torch.Generator().manual_seed(1), rule="naive")
    assert chi_square(wrong, probs) > limit


def test_drawing_the_targets_tokens_reproduces_its_distribution_and_accepts_as_often() -> None:
    P = markov_target(0)
    counts = sample_sequences(P, torch.Generator().manual_seed(5), rule="drawn")
    assert chi_square(counts, exact(P)) < chi_square_limit(V**L - 1)
    # the same acceptance probability as the rejection rule: p(d) for a point-mass drafter
    probs = P[[V, 0, 1]]
    drawn = lambda g: verify_drawn([0, 1], lambda i: int(torch.multinomial(probs[i], 1, generator=g)))
    for name, verify in (("rejection", lambda g: verify_sampled(torch.tensor([0, 1]), probs, g)), ("drawn", drawn)):
        generator = torch.Generator().manual_seed(6)
        first = sum(verify(generator).accepted >= 1 for _ in range(TRIALS)) / TRIALS
        assert abs(first - float(probs[0, 0])) < 4 * math.sqrt(0.25 / TRIALS), name


def test_drawing_the_targets_tokens_gives_the_plain_samplers_seeded_tokens() -> None:
    """One draw per emitted token, in order: the tokens do not depend on what was drafted."""
    P = markov_target(7)

    def decode(seed: int, drafter) -> list[int]:
        generator, out = torch.Generator().manual_seed(seed), []
        while len(out) < 12:
            last = out[-1] if out else V
            drafts = drafter(last)
            rows = [last, *drafts]  # the target's row after last, after d1, ...
            out += verify_drawn(drafts, lambda i: int(torch.multinomial(P[rows[i]], 1, generator=generator))).tokens
        return out[:12]

    for seed in range(20):
        plain = decode(seed, lambda last: [])
        assert decode(seed, lambda last: [draft_of(last), draft_of(draft_of(last))]) == plain
        assert decode(seed, lambda last: [draft_of(last)] * 3) == plain


def test_a_drafter_with_its_own_distribution_is_corrected_by_the_residual() -> None:
    generator = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.6, 0.1, 0.1, 0.2]], dtype=torch.float64)
    counts = torch.zeros(4)
    for _ in range(TRIALS):
        draft = torch.multinomial(q[0], 1, generator=generator)  # (1,) drawn from the drafter's q
        counts[verify_sampled(draft, p, generator, draft_probs=q).tokens[0]] += 1
    assert chi_square(counts, p[0]) < chi_square_limit(3)


def test_seeded_verification_is_reproducible() -> None:
    P = markov_target(3)
    runs = [[verify_sampled(torch.tensor([0, 1]), P[[V, 0, 1]], torch.Generator().manual_seed(s)).tokens
             for s in range(50)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_certain_drafts_are_always_accepted_and_impossible_ones_never() -> None:
    generator = torch.Generator().manual_seed(4)
    certain = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [0.5, 0.5, 0.0]])
    for _ in range(100):
        assert verify_sampled(torch.tensor([1, 2]), certain, generator).accepted == 2
        verdict = verify_sampled(torch.tensor([0, 2]), certain, generator)
        assert verdict.accepted == 0 and verdict.tokens == [1]  # p(0) = 0: rejected, and 1 is all p leaves


def test_residual() -> None:
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.0, 1.0, 0.0])
    assert torch.allclose(residual(p, q), torch.tensor([0.5, 0.0, 0.2]) / 0.7)
    assert torch.equal(residual(p, p), p)
