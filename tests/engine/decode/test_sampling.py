"""SamplingParams validation and the sampler: greedy rows, top-k and top-p supports, per-request generators."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeError, SamplingParams
from engine.decode.sampling import candidates, make_generator, sample

pytestmark = pytest.mark.unit
VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # (rows, vocab)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("inf")), ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("max_tokens", 0),
    ("max_tokens", -3), ("max_tokens", True), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop", [""]),
    ("stop", [3]), ("stop", ["x"] * 17), ("stop", ["x" * 257]),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(DecodeError, match=field):
        SamplingParams(**{field: value})


def test_stops_are_normalised_to_tuples():
    params = SamplingParams(stop_token_ids=[3, 1], stop="END")
    assert (params.stop_token_ids, params.stop) == ((3, 1), ("END",))


def test_greedy_rows_take_the_argmax_and_draw_nothing():
    logits = _logits(3)
    params = [SamplingParams(), SamplingParams(temperature=0.0, seed=4), SamplingParams(temperature=1.0, top_k=1)]
    generators = [make_generator(p, "cpu") for p in params]
    assert generators[:2] == [None, None]
    assert sample(logits, params, generators) == logits.argmax(-1).tolist()  # top_k=1 leaves only the argmax


def _draws(row: torch.Tensor, params: SamplingParams, n: int = 400) -> set[int]:
    generator = make_generator(params, "cpu")
    return {sample(row[None], [params], [generator])[0] for _ in range(n)}


def test_top_k_and_top_p_restrict_the_support():
    row = _logits(1)[0] / 2  # spread so that a nucleus of 0.8 holds several tokens
    order = row.argsort(descending=True).tolist()
    assert _draws(row, SamplingParams(temperature=2.0, top_k=3, seed=1)) == set(order[:3])
    probs = torch.softmax(row, -1)[order]
    nucleus = int((probs.cumsum(0) < 0.8).sum()) + 1  # the smallest head whose mass reaches 0.8
    assert nucleus > 1
    assert _draws(row, SamplingParams(temperature=1.0, top_p=0.8, seed=1)) == set(order[:nucleus])
    assert len(_draws(row, SamplingParams(temperature=5.0, seed=1))) > nucleus  # neither: wider


def test_a_rows_draws_depend_on_its_own_generator_only():
    logits = _logits(4)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 4)]

    def run(rows: list[int], steps: int = 20) -> list[list[int]]:
        generators = [make_generator(params[r], "cpu") for r in rows]
        drawn = [sample(logits[rows], [params[r] for r in rows], generators) for _ in range(steps)]
        return [list(column) for column in zip(*drawn)]

    together = run([0, 1, 2, 3])
    assert run([2]) == [together[2]]
    assert run([3, 0]) == [together[3], together[0]]
    assert together[0] != together[1]


def _sorted_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """temperature -> top-k -> top-p the plain way, sorting the whole vocabulary: probabilities (vocab,)."""
    scores = logits.float() / p.temperature
    if 0 < p.top_k < scores.numel():
        scores = scores.masked_fill(scores < torch.topk(scores, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    ordered, order = probs.sort(descending=True)
    ordered[ordered.cumsum(0) - ordered >= p.top_p] = 0
    return torch.zeros_like(probs).scatter_(0, order, ordered / ordered.sum())


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked, and so flat that the nucleus passes the first candidates
@pytest.mark.parametrize("params", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_p=0.5, top_k=40),
                                    dict(temperature=0.9, top_k=7), dict(temperature=1.1)])
def test_candidates_give_the_distribution_a_full_sort_gives(scale, params):
    from engine.decode.sampling import CANDIDATES, candidates

    logits = torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * scale
    p = SamplingParams(**params)
    tokens, weights = candidates(logits, p)
    got = torch.zeros(50_000).index_add_(0, tokens, weights / weights.sum())
    expected = _sorted_reference(logits, p)
    assert (got - expected).abs().max().item() < 1e-6
    if scale < 1 and p.top_k == 0 and p.top_p < 1:
        assert int((expected > 0).sum()) > CANDIDATES  # the nucleus did pass the first candidate set


def test_a_tiny_temperature_is_all_but_greedy_never_nan():
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(5)) * 30
    params = [SamplingParams(temperature=1e-300, top_p=0.9, seed=1), SamplingParams(temperature=1e-300, seed=2)]
    assert sample(logits, params, [make_generator(p, "cpu") for p in params]) == logits.argmax(-1).tolist()


def test_top_k_keeps_the_tokens_tied_with_the_kth():
    """As transformers' TopKLogitsWarper: ties with the k-th likeliest stay in (bf16 logits tie often)."""
    from engine.decode.sampling import candidates

    tokens, weights = candidates(torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    assert sorted(tokens.tolist()) == [0, 1, 2, 3] and int(tokens[0]) == 0 and bool((weights > 0).all())


# top_p at and past float32's edges: below its smallest subnormal (~1.4e-45) a Python float compares as fp32 0.0
TINY_TOP_P = [5e-324, 1e-300, 1e-100, 7e-46, 8e-46, 1.4e-45, 1.5e-45, 1e-38, 1e-7]
EXTREMES = [
    *(SamplingParams(temperature=1.0, top_p=p, seed=1) for p in TINY_TOP_P),
    *(SamplingParams(temperature=t, top_p=p, seed=2) for t in (5e-324, 1e-300, 1e300, 1.7e308)
      for p in (1e-300, 0.5, 1 - 2**-53, 1.0)),
    *(SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=2**64 - 1) for k in (1, VOCAB - 1, VOCAB, 2**62)
      for p in (5e-324, 1 - 2**-53)),
]


@pytest.mark.parametrize("params", EXTREMES, ids=lambda p: f"t{p.temperature:g}-k{p.top_k}-p{p.top_p:g}")
def test_every_sampling_value_in_range_draws_a_token(params):
    """The documented ranges hold to their edges: a top_p whatever its size keeps at least the likeliest token,
    so the draw never meets an empty distribution (multinomial raised, failing every row of the batch)."""
    logits = _logits(2, seed=3)
    drawn = sample(logits, [params, params], [make_generator(params, "cpu") for _ in range(2)])
    assert all(0 <= token < VOCAB for token in drawn)
    if params.top_p < 1e-7 and params.temperature <= 1:  # the nucleus is the likeliest token alone
        assert drawn == logits.argmax(-1).tolist()


def test_errors_name_a_few_refused_ids_and_count_them():
    with pytest.raises(DecodeError) as refused:
        SamplingParams(stop_token_ids=range(-200_000, 0))
    assert "(200000 in all)" in str(refused.value) and len(str(refused.value)) < 200


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, top_p=0.9)],
                         ids=["whole", "top_p"])
def test_candidates_lie_on_the_logits_device(params):
    """Tokens on another device than the weights fail the draw's indexing on a GPU: a device of its own
    (meta: shapes only, nothing computed) shows where each result was made."""
    logits = torch.empty(VOCAB, device="meta")
    tokens, weights = candidates(logits, params)
    assert tokens.device == weights.device == logits.device
