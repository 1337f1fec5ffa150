"""SamplingParams validation and the sampler: greedy rows, top-k and top-p supports, per-request generators."""

from __future__ import annotations

import pytest
import torch

from engine.decode import DecodeError, SamplingParams
from engine.decode.sampling import make_generator, sample

pytestmark = pytest.mark.unit
VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3  # (rows, vocab)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("temperature", float("inf")), ("temperature", "hot"), ("top_k", -1), ("top_k", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("seed", -1), ("seed", 2**64), ("seed", 1.0), ("max_tokens", 0),
    ("max_tokens", -3), ("max_tokens", True), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("stop", [""]),
    ("stop", [3]),
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
